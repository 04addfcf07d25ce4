"""Builds the kernel simulator of tests/test_kernels_sim*.py
(docs/decisions/0009-checking-npu-code-without-hardware.md): the Ascend kernels (csrc/kernels) and the harness
tests/kernels_sim/sim_main.cpp compiled with g++ against pto-isa's CPU simulator. Built once per test session
(tests/conftest.py `simulator`), shared by every simulator test file."""
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTO_ISA_ROOT = os.environ.get("PTO_ISA_ROOT")


def _patched_include_dir(tmp):
    """g++ 12 rejects pto-isa's `static_assert(false)` in an uninstantiated template (pto-isa wants g++ >= 13): put a
    copy that defers the assertion to instantiation first on the include path. Never written into the repo."""
    src = os.path.join(PTO_ISA_ROOT, "include", "pto", "cpu", "TReduceIdx.hpp")
    with open(src) as f:
        text = f.read()
    patched = text.replace('static_assert(false, "Unsupported element cmp.");',
                           'static_assert(sizeof(DType) == 0, "Unsupported element cmp.");')
    dst_dir = os.path.join(tmp, "pto_patch", "pto", "cpu")
    os.makedirs(dst_dir, exist_ok=True)
    with open(os.path.join(dst_dir, "TReduceIdx.hpp"), "w") as f:
        f.write(patched)
    return os.path.join(tmp, "pto_patch")


def _compile_flags(tmp):
    cxx = os.environ.get("CXX", "g++")
    # The strict simulator's flags (docs/decisions/0009-checking-npu-code-without-hardware.md); pto-isa as a system
    # include directory (patched copy first) so that its own warnings do not
    # drown ours. PTO_CPU_MAX_THREADS=1: every block is already a thread, no nested pools.
    flags = ["-std=c++20", "-O2", "-D__CPU_SIM", "-DPTO_CPU_MAX_THREADS=1", "-Wall", "-Wextra",
             "-include", "stdint.h", "-include", "stddef.h", "-include", "pto/pto-inst.hpp",
             "-isystem", _patched_include_dir(tmp), "-isystem", os.path.join(PTO_ISA_ROOT, "include"),
             "-I" + os.path.join(ROOT, "csrc", "include"), "-I" + os.path.join(ROOT, "csrc", "kernels"),
             "-I" + os.path.join(ROOT, "csrc", "host")]
    # e.g. GEMM_AR_SIM_CXXFLAGS="-fsanitize=thread -g" runs the same protocol under a sanitizer.
    extra = os.environ.get("GEMM_AR_SIM_CXXFLAGS", "").split()
    return cxx, flags + extra, extra


def _build(tmp):
    """The simulator binary; the two kernels and the harness compile in parallel."""
    cxx, flags, extra = _compile_flags(tmp)
    jobs, objects = [], []
    for src in (os.path.join(ROOT, "csrc", "kernels", "gemm_compute_kernel.cpp"),
                os.path.join(ROOT, "csrc", "kernels", "gemm_comm_kernel.cpp"),
                os.path.join(ROOT, "csrc", "kernels", "sp_compute_kernel.cpp"),
                os.path.join(ROOT, "csrc", "kernels", "sp_comm_kernel.cpp"),
                os.path.join(ROOT, "tests", "kernels_sim", "sim_main.cpp"),
                os.path.join(ROOT, "csrc", "host", "npu", "ring_context.cpp")):
        obj = os.path.join(tmp, os.path.basename(src) + ".o")
        jobs.append(subprocess.Popen([cxx] + flags + ["-c", src, "-o", obj]))
        objects.append(obj)
    for job in jobs:
        assert job.wait() == 0, "compiling the simulator failed"
    binary = os.path.join(tmp, "gemm_ar_sim")
    subprocess.run([cxx] + objects + ["-o", binary, "-pthread"] + extra, check=True)
    return binary


def build_simulator(tmp):
    """{"binary": path, "bf16_native": whether the simulator stores bfloat16 natively (g++ >= 13)}."""
    binary = _build(tmp)
    info = subprocess.run([binary, "info"], check=True, capture_output=True, text=True).stdout.split()
    return {"binary": binary, "bf16_native": info == ["bf16_native", "1"]}
