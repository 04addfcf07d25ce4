"""The module gemm_ar_engine_observation (tests/engine_observation/observation_bindings.cpp): the CPU engine's
geometry rules, data-flow plan, call counters, owner's reduction and tuner rule as the tests observe them, kept out
of the product's bindings (docs/decisions/0015-test-hooks.md).

It is compiled against the engine's headers but not linked with torch_gemm_ar._C: loading it first makes the _C this
process already loaded (the product, or the test build in a `hooked_ranks` rank) global, so its undefined symbols
bind to that library and the counters it reads are that library's own. `observe` is a lazy handle: tests write
`observe.one_shot_calls()` in the main process and in rank processes alike."""
import ctypes
import importlib.util
import os
import subprocess
import sys
import sysconfig

from cached_build import ROOT, cached_build

NAME = "gemm_ar_engine_observation"
SOURCE = os.path.join("tests", "engine_observation", "observation_bindings.cpp")
# The engine's headers it is compiled against: a change to them rebuilds it.
INPUTS = [SOURCE, os.path.join("csrc", "host"), os.path.join("csrc", "include")]


def _build(directory):
    import torch
    import torch.utils.cpp_extension as ext

    out = os.path.join(directory, NAME + sysconfig.get_config_var("EXT_SUFFIX"))
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # As torch's extension builder compiles the product (-std=c++20): the engine's headers use C++20.
    cmd = [os.environ.get("CXX", "g++"), "-std=c++20", "-O1", "-shared", "-fPIC", "-Wall", "-Wextra",
           "-Wno-unused-parameter", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DTORCH_EXTENSION_NAME={NAME}",
           "-I" + sysconfig.get_paths()["include"], "-I" + os.path.join(ROOT, "csrc", "include"),
           "-I" + os.path.join(ROOT, "csrc", "host")]
    cmd += ["-isystem" + p for p in ext.include_paths()]
    cmd += [os.path.join(ROOT, SOURCE), "-o", out]
    cmd += ["-L" + p for p in ext.library_paths()] + ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"building {NAME} failed:\n{' '.join(cmd)}\n{result.stderr[-6000:]}")


def observation_module_path():
    """The module's shared object, built for the current sources if needed (about 30 s on 2 cores)."""
    directory = cached_build("engine-observation", INPUTS, _build)
    return os.path.join(directory, NAME + sysconfig.get_config_var("EXT_SUFFIX"))


def _load():
    if NAME in sys.modules:
        return sys.modules[NAME]
    from torch_gemm_ar import _C

    # The _C this process loaded, promoted to global scope without loading a second copy.
    ctypes.CDLL(_C.__file__, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL | os.RTLD_NOW)
    spec = importlib.util.spec_from_file_location(NAME, observation_module_path())
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[NAME] = module
    return module


class _Lazy:
    def __getattr__(self, name):
        return getattr(_load(), name)


observe = _Lazy()
