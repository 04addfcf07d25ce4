"""Rank-process side of the emulated NPU tests (tests/test_npu_emulated*.py; docs/decisions/0019-emulated-npu-runtime.md):
loads the emulated runtime into a rank of a RankPool, after torch_gemm_ar (which defines the pto schemas), and makes
the groups whose "npu" backend is the emulated HCCL."""
import importlib.util
import sys
import types

import torch
import torch.distributed as dist

BACKEND_PREFIX = "emulated_hccl"  # + "_mesh" / "_ring": one registered backend per topology
TOPOLOGIES = ("mesh", "ring")
_loaded = {}
_groups = {}


def _load_as(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _device_module(emu):
    """torch.npu as torch's Python side asks a PrivateUse1 backend for it (device moves initialise it lazily)."""
    module = types.ModuleType("torch.npu")
    module.is_available = lambda: True
    module.is_initialized = lambda: True
    module._lazy_init = lambda: None
    module.device_count = lambda: 1
    module.current_device = lambda: 0
    module.set_device = lambda device: None
    module.synchronize = lambda device=None: emu.synchronize()
    return module


def load(library):
    """The emulated runtime in this process (once): "npu" is PrivateUse1, torch_gemm_ar._C_npu is the product's host
    code on it, and the emulated HCCL is a c10d backend for "npu" tensors. Returns the gemm_ar_emu controls."""
    if "emu" in _loaded:
        assert _loaded["library"] == library, "one emulated runtime per rank process"
        return _loaded["emu"]
    import torch_gemm_ar
    from torch_gemm_ar.errors import register_error_checker

    torch.utils.rename_privateuse1_backend("npu")
    npu = _load_as("torch_gemm_ar._C_npu", library)  # registers the PrivateUse1 kernels, as the real one does
    torch_gemm_ar._C_npu = npu
    register_error_checker(npu.check_errors)
    emu = _load_as("gemm_ar_emu", library)
    emu.check_settings()
    torch._register_device_module("npu", _device_module(emu))

    def creator(mesh):
        def create(store, rank, size, timeout):
            gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
            return emu.make_backend(store, rank, size, gloo, mesh)

        return create

    for topology in TOPOLOGIES:  # one backend per topology HCCL reports: a group's topology is its backend's
        dist.Backend.register_backend(f"{BACKEND_PREFIX}_{topology}", creator(topology == "mesh"), devices=["npu"])
    _loaded.update(emu=emu, library=library)
    return emu


def group(library, topology="mesh", key=""):
    """A group of every rank with the emulated HCCL for "npu" tensors, one per (topology, key) in this process; its
    communicator is set up by its first fused call, with HCCL reporting `topology` ("mesh" or "ring")."""
    load(library)
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology={topology!r}: one of {TOPOLOGIES}")
    if (topology, key) not in _groups:
        g = dist.new_group(list(range(dist.get_world_size())), backend=f"cpu:gloo,npu:{BACKEND_PREFIX}_{topology}")
        _groups[(topology, key)] = g
    return _groups[(topology, key)]


def forget(destroyed):
    """Drops a destroyed group from this process's groups."""
    for key, g in list(_groups.items()):
        if g is destroyed:
            del _groups[key]
