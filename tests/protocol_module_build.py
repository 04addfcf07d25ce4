"""The module gemm_ar_protocol (tests/protocol_module/protocol_bindings.cpp): the tile-protocol headers of
csrc/include/gemm_ar bound to Python for tests/test_protocol.py. Only pybind11 (from torch's headers) and the
protocol headers: it loads beside torch_gemm_ar._C and registers nothing."""
import importlib.util
import os
import subprocess
import sys
import sysconfig

from cached_build import ROOT, cached_build

SOURCE = os.path.join("tests", "protocol_module", "protocol_bindings.cpp")


def _build(directory):
    import torch.utils.cpp_extension as ext

    out = os.path.join(directory, "gemm_ar_protocol" + sysconfig.get_config_var("EXT_SUFFIX"))
    cmd = [os.environ.get("CXX", "g++"), "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Wextra",
           "-I" + sysconfig.get_paths()["include"], "-I" + os.path.join(ROOT, "csrc", "include")]
    cmd += ["-isystem" + p for p in ext.include_paths()]
    cmd += [os.path.join(ROOT, SOURCE), "-o", out]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"building gemm_ar_protocol failed:\n{' '.join(cmd)}\n{result.stderr[-6000:]}")


def protocol_module():
    """gemm_ar_protocol, built for the current headers if needed."""
    if "gemm_ar_protocol" in sys.modules:
        return sys.modules["gemm_ar_protocol"]
    directory = cached_build("protocol", [SOURCE, os.path.join("csrc", "include")], _build)
    path = os.path.join(directory, "gemm_ar_protocol" + sysconfig.get_config_var("EXT_SUFFIX"))
    spec = importlib.util.spec_from_file_location("gemm_ar_protocol", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["gemm_ar_protocol"] = module
    return module
