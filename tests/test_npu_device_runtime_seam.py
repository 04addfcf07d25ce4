"""The NPU host code reaches the device only through its runtime seam (csrc/host/npu/device_runtime.h,
docs/decisions/0018-npu-device-runtime-seam.md): every file of csrc/host/npu other than the seam's Ascend
implementation names no torch_npu, ACL or HCCL header, namespace or function, and preprocesses with torch's headers
alone, so that another runtime (an emulated one) can be linked behind the same host logic without torch-npu; the
seam itself compiles as C++17 with torch's headers alone.

Negative controls put a torch_npu include, a torch_npu call and an ACL call into a copy of fused_npu.cpp."""
import os
import re
import shutil
import subprocess
import sysconfig

import pytest
import torch.utils.cpp_extension as cpp_extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NPU_DIR = os.path.join(ROOT, "csrc", "host", "npu")

# The seam's Ascend implementation: the only files that may use torch_npu, ACL and HCCL.
RUNTIME_IMPLEMENTATION = {
    "device_queue_npu.cpp", "device_control_npu.cpp", "device_event_npu.h",
    "hccl_symbols.cpp", "hccl_symbols.h", "hccl_internal_api.h",
}
HOST_LOGIC = sorted(os.path.join(NPU_DIR, f) for f in os.listdir(NPU_DIR)
                    if f.endswith((".cpp", ".h")) and f not in RUNTIME_IMPLEMENTATION)

DENIED = [
    r"#\s*include\s*[<\"](torch_npu|acl|hccl)/",
    r"\b(c10_npu|c10d_npu|at_npu)::",
    r"\bacl(rt|op)?[A-Z]\w*\s*\(",  # aclrtMemcpy(, aclInit(, ...
    r"\bHc(cl|om)[A-Z]\w*\s*\(",  # HcclAllocComResourceByTiling(, HcomGetCommHandleByGroup(, ...
]


def _code_only(text):
    """The text without comments and string literals (messages may name the runtime's functions)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(\\.|[^"\\\n])*"', '""', text)


def runtime_uses(path):
    with open(path) as f:
        code = _code_only(f.read())
    return [f"{os.path.basename(path)}: {m.group(0)!r}" for pattern in DENIED for m in re.finditer(pattern, code)]


def preprocess_without_npu_headers(paths, tmp_path):
    """g++ -E of one unit including every file of `paths`, with torch's and the project's include paths only."""
    unit = tmp_path / "host_logic.cpp"
    unit.write_text("".join(f'#include "{p}"\n' for p in paths))
    third_party = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    command = ["g++", "-std=c++17", "-E", *[f"-I{os.path.join(ROOT, 'csrc', d)}" for d in ("include", "host", "kernels")],
               *[arg for d in third_party for arg in ("-isystem", d)], str(unit), "-o", os.devnull]
    return subprocess.run(command, capture_output=True, text=True)


def test_host_logic_names_no_npu_runtime():
    assert len(HOST_LOGIC) >= 10, HOST_LOGIC
    found = [use for path in HOST_LOGIC for use in runtime_uses(path)]
    assert not found, "host logic past the device runtime seam (use npu/device_runtime.h):\n" + "\n".join(found)


@pytest.fixture
def gxx():
    if not shutil.which("g++"):
        pytest.skip("g++ is needed to preprocess the NPU host code")


def test_host_logic_preprocesses_without_npu_headers(gxx, tmp_path):
    result = preprocess_without_npu_headers(HOST_LOGIC, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]


def test_the_seam_compiles_as_cxx17_with_torch_headers_alone(gxx, tmp_path):
    # What an emulated runtime implements: device_runtime.h, with no torch-npu anywhere on the include path.
    unit = tmp_path / "seam.cpp"
    unit.write_text('#include "npu/device_runtime.h"\n')
    command = ["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", f"-I{os.path.join(ROOT, 'csrc', 'host')}",
               *[arg for d in cpp_extension.include_paths() for arg in ("-isystem", d)], str(unit)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0 and "warning" not in result.stderr, result.stderr[-4000:]


INJECTIONS = {
    "torch_npu_include": "#include <torch_npu/csrc/core/npu/NPUStream.h>\n",
    "torch_npu_call": "static void f() { (void)c10_npu::getCurrentNPUStream(0); }\n",
    "acl_call": "static void f() { (void)aclrtSynchronizeStream(nullptr); }\n",
}


@pytest.mark.parametrize("name", sorted(INJECTIONS))
def test_negative_control_runtime_use_in_host_logic_is_caught(tmp_path, name):
    with open(os.path.join(NPU_DIR, "fused_npu.cpp")) as f:
        text = f.read()
    broken = tmp_path / "fused_npu.cpp"
    broken.write_text(text + INJECTIONS[name])
    assert runtime_uses(str(broken)), f"{name} went unnoticed"


def test_negative_control_torch_npu_include_does_not_preprocess(gxx, tmp_path):
    broken = tmp_path / "fused_npu.cpp"
    with open(os.path.join(NPU_DIR, "fused_npu.cpp")) as f:
        broken.write_text(INJECTIONS["torch_npu_include"] + f.read())
    result = preprocess_without_npu_headers([str(broken)], tmp_path)
    assert result.returncode != 0 and "torch_npu/csrc/core/npu/NPUStream.h" in result.stderr, result.stderr[-2000:]


def test_build_runtime_sources_are_the_seam_implementation():
    """build_npu.RUNTIME_SOURCES (what the emulated build leaves out, tests/npu_emulated_build.py) are exactly the
    implementation's sources: a new runtime file missing there would be linked into the emulated build."""
    from cached_build import root_script

    build_npu = root_script("build_npu")

    runtime = {os.path.basename(s) for s in build_npu.RUNTIME_SOURCES}
    assert runtime == {f for f in RUNTIME_IMPLEMENTATION if f.endswith(".cpp")}
