"""What Megatron-core 0.19.2 needs to import on a CPU-only machine, shared by examples/megatron_tp.py and
tests/test_megatron.py: megatron.core imports its MoE paged-stash triton kernels at import time (triton is not
installed without CUDA), though no dense model calls them. Stubbed before the first Megatron import; a call into
the stub raises, naming the kernel."""
import sys
import types

TRITON_ONLY = "megatron.core.transformer.moe.ops.paged_stash"


def stub_triton_only_module() -> None:
    if TRITON_ONLY in sys.modules:
        return
    stub = types.ModuleType(TRITON_ONLY)
    stub.GLOBAL_BLOCK_SIZE = 1024

    def missing(name):
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args, **kwargs):
            raise RuntimeError(f"{TRITON_ONLY}.{name} needs triton (stubbed on CPU by examples/megatron_cpu.py)")
        return kernel

    stub.__getattr__ = missing
    sys.modules[TRITON_ONLY] = stub
