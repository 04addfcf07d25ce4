"""Builds the kernel simulator of tests/test_kernels_sim*.py
(docs/decisions/0009-checking-npu-code-without-hardware.md): the Ascend kernels (csrc/kernels) and the harness
tests/kernels_sim/sim_main.cpp compiled with g++ against pto-isa's CPU simulator. The kernels' objects are built once
per change of their sources (tests/cached_build.py, build/tests/sim-kernels-*) and shared with the emulated NPU
runtime (tests/npu_emulated_build.py); the harness is built once per test session (tests/conftest.py `simulator`),
shared by every simulator test file."""
import os
import subprocess

from cached_build import cached_build

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


KERNEL_SOURCES = ["csrc/kernels/gemm_compute_kernel.cpp", "csrc/kernels/gemm_comm_kernel.cpp",
                  "csrc/kernels/sp_compute_kernel.cpp", "csrc/kernels/sp_comm_kernel.cpp"]
KERNEL_INPUTS = ["csrc/kernels", "csrc/include", "tests/kernel_sim_build.py", "tests/cached_build.py"]
HARNESS_SOURCES = ["tests/kernels_sim/sim_main.cpp", "csrc/host/npu/ring_context.cpp"]


def _compile_all(cxx, flags, sources, directory):
    """`sources` compiled in parallel into `directory`; their objects."""
    jobs, objects = [], []
    for src in sources:
        obj = os.path.join(directory, object_name(src))
        jobs.append(subprocess.Popen([cxx] + flags + ["-c", os.path.join(ROOT, src), "-o", obj]))
        objects.append(obj)
    for job in jobs:
        assert job.wait() == 0, "compiling for the simulator failed"
    return objects


def object_name(src):
    return "sim_" + os.path.basename(src) + ".o"


# pto-isa's simulator makes a global-memory atomic add atomic with a process-local mutex (pto/cpu/atomic.hpp), which
# serialises the ranks of one simulator process but not rank processes adding into a shared-memory window at once:
# their adds would be lost now and then. The kernel build's copies of the headers that add make each add one
# compare-and-swap on the aligned word holding the element, atomic across processes, still under the mutex: in one
# process (the simulator binary) every add still runs alone and stores the same value, so the simulator sees what
# pto-isa's own add gives, and one build of the kernels serves both (docs/decisions/0019-emulated-npu-runtime.md).
CROSS_PROCESS_ADD = """
namespace pto::cpu {
// tests/kernel_sim_build.py: an add into memory other processes (emulated NPU ranks) may add into as well. The
// element is updated inside the aligned 4- or 8-byte word that holds it, with one compare-and-swap, acquire-release
// as the mutex it replaces; the word is raw device memory, read and written only through these builtins here.
template <typename T>
inline void CrossProcessAdd(T* element, const T& summand)
{
    static_assert(sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8, "unsupported element size");
    using Word = std::conditional_t<sizeof(T) <= 4, uint32_t, uint64_t>;
    const uintptr_t address = reinterpret_cast<uintptr_t>(element);
    Word* word = reinterpret_cast<Word*>(address & ~static_cast<uintptr_t>(sizeof(Word) - 1));
    const size_t at = address - reinterpret_cast<uintptr_t>(word);
    Word seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    for (;;) {
        T value;
        std::memcpy(&value, reinterpret_cast<const unsigned char*>(&seen) + at, sizeof(T));
        value = static_cast<T>(value + summand);
        Word next = seen;
        std::memcpy(reinterpret_cast<unsigned char*>(&next) + at, &value, sizeof(T));
        if (__atomic_compare_exchange_n(word, &seen, next, true, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return;
    }
}
} // namespace pto::cpu
"""
ATOMIC_ADD_PATCHES = {
    "pto/cpu/atomic.hpp": [("} // namespace pto::cpu\n", "} // namespace pto::cpu\n" + CROSS_PROCESS_ADD),
                           ("#include <mutex>\n", "#include <mutex>\n#include <cstdint>\n#include <cstring>\n"
                                                  "#include <type_traits>\n")],
    "pto/common/pto_tile.hpp": [("data()[offset] += summand;", "cpu::CrossProcessAdd(&data()[offset], summand);")],
    "pto/cpu/common.hpp": [("dst[dstIdx] += converted;", "cpu::CrossProcessAdd(&dst[dstIdx], converted);")],
}


def _cross_process_add_includes(directory):
    """Copies of pto-isa's headers with ATOMIC_ADD_PATCHES applied (each must apply), never written into pto-isa."""
    out = os.path.join(directory, "pto_cross_process_add")
    for header, replacements in ATOMIC_ADD_PATCHES.items():
        with open(os.path.join(PTO_ISA_ROOT, "include", header)) as f:
            text = f.read()
        for old, new in replacements:
            if old not in text:
                raise RuntimeError(f"{header} of pto-isa changed: {old!r} not found (tests/kernel_sim_build.py)")
            text = text.replace(old, new)
        os.makedirs(os.path.dirname(os.path.join(out, header)), exist_ok=True)
        with open(os.path.join(out, header), "w") as f:
            f.write(text)
    return out


def kernel_flags(directory):
    """(cxx, flags, extra) of every unit that includes pto-isa in a shared kernel build: the simulator's flags with
    the cross-process adds first on the include path and -fPIC (the emulated runtime links the same objects into a
    shared object). One set of flags for all of them: pto-isa's inline functions must be the same in every unit."""
    cxx, flags, extra = _compile_flags(directory)
    return cxx, ["-isystem", _cross_process_add_includes(directory)] + flags + ["-fPIC"], extra


def cache_flags():
    """What a cached simulator build depends on besides its sources and toolchain: GEMM_AR_SIM_CXXFLAGS and the
    contents of pto-isa's headers (another checkout or an update rebuilds; the patched copies derive from them)."""
    import hashlib

    digest = hashlib.sha256()
    include = os.path.join(PTO_ISA_ROOT, "include")
    for base, _, names in sorted(os.walk(include)):
        for name in sorted(names):
            path = os.path.join(base, name)
            digest.update(os.path.relpath(path, include).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return f"{os.environ.get('GEMM_AR_SIM_CXXFLAGS', '')}|pto-isa {digest.hexdigest()}"


def kernel_objects_dir():
    """The directory of the four kernels' objects (object_name), built with kernel_flags at the first use after a
    change of their sources, toolchain, GEMM_AR_SIM_CXXFLAGS or pto-isa (cache_flags)."""
    if not PTO_ISA_ROOT:
        raise RuntimeError("PTO_ISA_ROOT is not set: the kernels build against pto-isa's CPU simulator")

    def build(directory):
        cxx, flags, _ = kernel_flags(directory)
        _compile_all(cxx, flags, KERNEL_SOURCES, directory)

    return cached_build("sim-kernels", KERNEL_INPUTS, build, flags=cache_flags())


def _build(tmp):
    """The simulator binary: the shared kernel objects and the harness, compiled with the same flags."""
    kernel_dir = kernel_objects_dir()
    cxx, flags, extra = kernel_flags(tmp)
    objects = [os.path.join(kernel_dir, object_name(src)) for src in KERNEL_SOURCES]
    objects += _compile_all(cxx, flags, HARNESS_SOURCES, tmp)
    binary = os.path.join(tmp, "gemm_ar_sim")
    subprocess.run([cxx] + objects + ["-o", binary, "-pthread"] + extra, check=True)
    return binary


def build_simulator(tmp):
    """{"binary": path, "bf16_native": whether the simulator stores bfloat16 natively (g++ >= 13)}."""
    binary = _build(tmp)
    info = subprocess.run([binary, "info"], check=True, capture_output=True, text=True).stdout.split()
    return {"binary": binary, "bf16_native": info == ["bf16_native", "1"]}
