"""Decides whether the Ascend NPU pieces can be built on this machine and builds them (docs/architecture.md §2.2
and §2.8, docs/ascend.md).

Where CANN (ASCEND_HOME_PATH, bisheng) and torch_npu are present, npu_extensions() compiles the PTO kernels (KERNELS below) with
bisheng into shared libraries inside the package (torch_gemm_ar/libgemm_ar_*compute.so for the cube cores,
torch_gemm_ar/libgemm_ar_*comm.so for the vector cores) and returns the host extension torch_gemm_ar._C_npu, linked
against them, torch_npu and ACL with the C++ ABI torch reports. Elsewhere it prints one line and returns [].
"""
import glob
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess

# SoC families the kernels target, by SOC_VERSION prefix: A2 (Atlas 800T A2 / 900 A2) and A3 (Atlas 800T A3 /
# 900 A3 SuperPoD) both have "c220" cores. pto-isa derives PTO_NPU_ARCH_A2A3 from __NPU_ARCH__ in the device pass
# only; the host pass of -xcce needs it spelled out (as pto-isa's own builds do).
A2A3 = {"cube": "dav-c220-cube", "vec": "dav-c220-vec", "define": "PTO_NPU_ARCH_A2A3"}
SOC_ARCHES = (
    (re.compile(r"^Ascend910B\d"), A2A3),
    (re.compile(r"^Ascend910_93\d\d"), A2A3),
)

# (library name, kernel source, which core type it runs on)
KERNELS = (
    ("gemm_ar_compute", "csrc/kernels/gemm_compute_kernel.cpp", "cube"),
    ("gemm_ar_comm", "csrc/kernels/gemm_comm_kernel.cpp", "vec"),
    ("gemm_ar_sp_compute", "csrc/kernels/sp_compute_kernel.cpp", "cube"),  # gemm_reduce_scatter / allgather_gemm
    ("gemm_ar_sp_comm", "csrc/kernels/sp_comm_kernel.cpp", "vec"),
)

# Options of pto-isa's own AICore builds (kernels/manual/a2a3/gemm_ar/CMakeLists.txt).
BISHENG_KERNEL_FLAGS = [
    "-xcce",
    "-O2",
    "-std=c++17",
    "-fPIC",
    "-DMEMORY_BASE",
    "--cce-pto-enable",
    "-Wno-macro-redefined",
    "-Wno-ignored-attributes",
    "-mllvm", "-cce-aicore-stack-size=0x8000",
    "-mllvm", "-cce-aicore-function-stack-size=0x8000",
    "-mllvm", "-cce-aicore-record-overflow=true",
    "-mllvm", "-cce-aicore-addr-transform",
    "-mllvm", "-cce-aicore-dcci-insert-for-scalar=false",
]

# AscendC headers the PTO headers build on; their place differs between CANN releases, so only existing ones are used.
CANN_KERNEL_INCLUDE_SUBDIRS = (
    "asc",
    "asc/include",
    "asc/impl/basic_api",
    "asc/include/interface",
    "asc/include/utils",
    "ascendc/include/basic_api",
    "ascendc/include/basic_api/impl",
    "include/ascendc/basic_api",
)


def _torch_npu_dir():
    """The installed torch_npu package directory, found without importing it (importing needs a device)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch_npu")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def cann_missing_reason():
    """Why the NPU build cannot run here, or None when CANN (bisheng) and torch_npu are all present."""
    if os.environ.get("TORCH_GEMM_AR_BUILD_NPU", "1") == "0":
        return "TORCH_GEMM_AR_BUILD_NPU=0"
    if not os.environ.get("ASCEND_HOME_PATH"):
        return "ASCEND_HOME_PATH is not set"
    if shutil.which("bisheng") is None:
        return "bisheng is not on PATH"
    if _torch_npu_dir() is None:
        return "torch_npu is not installed"
    return None


def aicore_arches(soc_version):
    """{"cube": arch, "vec": arch, "define": macro} for SOC_VERSION; arch is a --cce-aicore-arch value."""
    for pattern, arches in SOC_ARCHES:
        if pattern.match(soc_version):
            return arches
    raise RuntimeError(
        f"torch-gemm-ar: SOC_VERSION={soc_version!r} is not supported by the PTO kernels; use an A2 "
        "(Ascend910B1..B4) or A3 (Ascend910_93xx) SoC name, e.g. SOC_VERSION=Ascend910B3"
    )


def _required_env(name, hint):
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(f"torch-gemm-ar: building the Ascend NPU backend needs {name}: {hint}")
    return value


def _cxx11_abi():
    import torch

    return int(torch.compiled_with_cxx11_abi())


def kernel_commands(root, out_dir, obj_dir, soc_version, pto_isa_root, ascend_home):
    """The bisheng commands (compile, link) of each kernel library, as lists of arguments."""
    arches = aicore_arches(soc_version)
    host_arch_dir = os.path.join(ascend_home, f"{platform.machine()}-linux")
    cann_includes = [os.path.join(host_arch_dir, d) for d in CANN_KERNEL_INCLUDE_SUBDIRS]
    cann_includes = [d for d in cann_includes if os.path.isdir(d)] + [os.path.join(ascend_home, "include")]
    # pto-isa first: CANN ships older copies of some PTO headers.
    includes = [os.path.join(pto_isa_root, "include"), os.path.join(root, "csrc", "include"),
                os.path.join(root, "csrc", "kernels"), *cann_includes]
    commands = []
    for name, source, core in KERNELS:
        obj = os.path.join(obj_dir, f"{name}.o")
        lib = os.path.join(out_dir, f"lib{name}.so")
        compile_cmd = ["bisheng", *BISHENG_KERNEL_FLAGS, f"--cce-aicore-arch={arches[core]}",
                       f"-D{arches['define']}", f"-D_GLIBCXX_USE_CXX11_ABI={_cxx11_abi()}",
                       *[f"-I{d}" for d in includes], "-c",
                       os.path.join(root, source), "-o", obj]
        link_cmd = ["bisheng", "-shared", "--cce-fatobj-link", obj, "-o", lib, f"-Wl,-soname,lib{name}.so",
                    f"-L{os.path.join(ascend_home, 'lib64')}", "-lruntime"]
        commands.append((name, lib, compile_cmd, link_cmd))
    return commands


def _kernel_inputs(root):
    patterns = ("csrc/kernels/*", "csrc/include/gemm_ar/*")
    return sorted(p for pattern in patterns for p in glob.glob(os.path.join(root, pattern)) if os.path.isfile(p))


def build_kernel_libraries(root):
    """Compiles the kernels unless the libraries are newer than every input and were built with the same commands.
    Returns the package directory that holds them."""
    soc_version = _required_env("SOC_VERSION", "the SoC to compile for, e.g. SOC_VERSION=Ascend910B3 (npu-smi info)")
    pto_isa_root = _required_env("PTO_ISA_ROOT", "a checkout of https://github.com/hw-native-sys/pto-isa")
    ascend_home = os.environ["ASCEND_HOME_PATH"]
    out_dir = os.path.join(root, "torch_gemm_ar")
    obj_dir = os.path.join(root, "build", "npu_kernels", soc_version)
    os.makedirs(obj_dir, exist_ok=True)
    commands = kernel_commands(root, out_dir, obj_dir, soc_version, pto_isa_root, ascend_home)

    stamp_path = os.path.join(obj_dir, "commands.json")
    digest = hashlib.sha256(json.dumps([c[2:] for c in commands]).encode()).hexdigest()
    newest_input = max(os.path.getmtime(p) for p in _kernel_inputs(root))
    try:
        with open(stamp_path) as f:
            same_commands = json.load(f).get("digest") == digest
    except (OSError, ValueError):
        same_commands = False
    for name, lib, compile_cmd, link_cmd in commands:
        if same_commands and os.path.isfile(lib) and os.path.getmtime(lib) >= newest_input:
            continue
        print(f"torch-gemm-ar: bisheng {name} for {soc_version}")
        for cmd in (compile_cmd, link_cmd):
            subprocess.run(cmd, check=True)
    with open(stamp_path, "w") as f:
        json.dump({"digest": digest}, f)
    return out_dir


# The host sources that call torch_npu, ACL or HCCL: the runtime behind the seam
# (docs/decisions/0018-npu-device-runtime-seam.md). The emulated runtime (tests/npu_emulated_build.py) builds every
# other host source with its own runtime instead of these.
RUNTIME_SOURCES = (
    "csrc/host/npu/device_control_npu.cpp",
    "csrc/host/npu/device_queue_npu.cpp",
    "csrc/host/npu/hccl_symbols.cpp",
)


def host_sources(root):
    """Every C++ source of torch_gemm_ar._C_npu (paths relative to `root`): the host logic and RUNTIME_SOURCES."""
    found = sorted(os.path.relpath(p, root) for pattern in ("csrc/host/npu/*.cpp", "csrc/host/common/*.cpp")
                   for p in glob.glob(os.path.join(root, pattern)))
    missing = [s for s in RUNTIME_SOURCES if s not in found]
    if missing:
        raise RuntimeError(f"torch-gemm-ar: build_npu.RUNTIME_SOURCES names files that do not exist: {missing}")
    return found


def host_logic_sources(root):
    """host_sources without the runtime: what any runtime behind the seam is linked with."""
    return [s for s in host_sources(root) if s not in RUNTIME_SOURCES]


def host_extension(root, kernel_dir):
    """torch_gemm_ar._C_npu: the PrivateUse1 kernel of the op, with its own copy of the shared op flow."""
    from torch.utils.cpp_extension import CppExtension, include_paths

    torch_npu_dir = _torch_npu_dir()
    npu_include = os.path.join(torch_npu_dir, "include")

    # torch_npu's headers as system headers: their warnings are not ours.
    system_includes = [
        os.path.join(include_paths()[0], "torch", "csrc", "distributed"),  # torch_npu includes c10d/...
        npu_include,
        os.path.join(npu_include, "third_party", "hccl", "inc"),
        os.path.join(npu_include, "third_party", "acl", "inc"),
    ]
    return CppExtension(
        "torch_gemm_ar._C_npu",
        sources=host_sources(root),
        include_dirs=[os.path.join(root, "csrc", d) for d in ("include", "host", "kernels")],
        library_dirs=[kernel_dir, os.path.join(torch_npu_dir, "lib"),
                      os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64")],
        libraries=[name for name, _, _ in KERNELS] + ["torch_npu", "ascendcl"],
        extra_compile_args=["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter",
                            *[arg for d in system_includes for arg in ("-isystem", d)]],
        # The kernel libraries sit next to the extension; torch_npu and CANN are loaded before it (import torch_npu).
        extra_link_args=["-Wl,-rpath,$ORIGIN"],
    )


def npu_extensions(root):
    reason = cann_missing_reason()
    if reason is not None:
        print(f"torch-gemm-ar: skipping the Ascend NPU backend ({reason}); building the CPU extension only")
        return []
    print(f"torch-gemm-ar: building the Ascend NPU backend for SOC_VERSION={os.environ.get('SOC_VERSION')}")
    kernel_dir = build_kernel_libraries(root)
    return [host_extension(root, kernel_dir)]
