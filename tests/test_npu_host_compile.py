"""Check 1 (docs/decisions/0009-checking-npu-code-without-hardware.md): the NPU host code compiles against torch and the
real torch-npu 2.13.0 headers, and every torch_npu C++ symbol it uses is exported, with the same mangled name, by the
wheel's libtorch_npu.so.

No NPU, CANN or importable torch_npu is needed: the wheel is only read. Its location is TORCH_NPU_ROOT (a directory
holding torch_npu/include, e.g. from `pip install --no-deps --target <dir> torch-npu==2.13.0`), else an installed
torch_npu found without importing it.
"""
import concurrent.futures
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time

import pytest
import torch
import torch.utils.cpp_extension as cpp_extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NPU_SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "host", "npu", "*.cpp")))
# Namespaces whose symbols must come from libtorch_npu.so.
TORCH_NPU_NAMESPACES = ("c10_npu::", "c10d_npu::", "at_npu::")


def _torch_npu_package_dir():
    root = os.environ.get("TORCH_NPU_ROOT")
    if root:
        return os.path.join(root, "torch_npu")
    # find_spec on a top-level name locates the package without executing it (importing it would need CANN).
    spec = importlib.util.find_spec("torch_npu")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


TORCH_NPU_DIR = _torch_npu_package_dir()
TORCH_NPU_INCLUDE = os.path.join(TORCH_NPU_DIR, "include") if TORCH_NPU_DIR else None
HEADERS_MISSING = TORCH_NPU_INCLUDE is None or not os.path.isfile(
    os.path.join(TORCH_NPU_INCLUDE, "torch_npu", "csrc", "distributed", "ProcessGroupHCCL.hpp")
)
pytestmark = pytest.mark.skipif(
    HEADERS_MISSING,
    reason="torch-npu 2.13.0 headers not found (TORCH_NPU_ROOT="
    + repr(os.environ.get("TORCH_NPU_ROOT"))
    + "): set TORCH_NPU_ROOT to a directory containing torch_npu/include, "
    "e.g. pip install --no-deps --target <dir> torch-npu==2.13.0",
)


def compile_command(source, output):
    torch_include = cpp_extension.include_paths()[0]
    third_party = [
        *cpp_extension.include_paths(),
        os.path.join(torch_include, "torch", "csrc", "distributed"),  # torch_npu includes c10d/ProcessGroup.hpp
        sysconfig.get_paths()["include"],
        TORCH_NPU_INCLUDE,
        os.path.join(TORCH_NPU_INCLUDE, "third_party", "hccl", "inc"),
        os.path.join(TORCH_NPU_INCLUDE, "third_party", "acl", "inc"),
    ]
    project = [os.path.join(ROOT, "csrc", d) for d in ("include", "host", "kernels")]
    return [
        "g++",
        "-std=c++20",  # what torch 2.13's cpp_extension builds with
        "-c",
        "-O0",
        "-fPIC",
        "-Wall",
        "-Wextra",
        "-Wno-unused-parameter",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        *[f"-I{d}" for d in project],
        # Third-party headers as system headers: their warnings are not ours.
        *[arg for d in third_party for arg in ("-isystem", d)],
        source,
        "-o",
        output,
    ]


class Compiled:
    def __init__(self, returncode, stderr, seconds, obj):
        self.returncode, self.stderr, self.seconds, self.obj = returncode, stderr, seconds, obj


# The torch headers nearly every host source includes, parsed once into a precompiled header: parsing them is most
# of a source's compile at -O0.
PRECOMPILED = ("ATen/ATen.h", "torch/csrc/distributed/c10d/ProcessGroup.hpp")


def _without_output(command):
    i = command.index("-o")
    return [arg for arg in command[:i] + command[i + 2:] if arg != "-c"]


def include_tree(source):
    """(depth, path) of every header `source` includes, in the order the preprocessor enters them (gcc -H;
    preprocessing only, far cheaper than a compile)."""
    proc = subprocess.run(_without_output(compile_command(source, os.devnull)) + ["-E", "-H", "-o", os.devnull],
                          capture_output=True, text=True)
    tree = []
    for line in proc.stderr.splitlines():
        dots = len(line) - len(line.lstrip("."))
        if dots and line[dots:dots + 1] == " ":
            tree.append((dots, line[dots + 1:]))
    return tree


def precompiled_header_changes_nothing(tree, project_root):
    """Whether forcing PRECOMPILED in first changes nothing for the project's own code: the source includes every
    header of it, and no project header is finished before the last of them is entered (one that were could use
    at:: without including ATen, and the forced header would hide that)."""
    missing, open_headers = set(PRECOMPILED), []
    for depth, path in tree:
        while len(open_headers) >= depth:  # the ones at this depth or deeper are finished
            if open_headers.pop().startswith(project_root):
                return False
        open_headers.append(path)
        missing -= {h for h in missing if path.endswith("/" + h)}
        if not missing:
            return True
    return False


class ObjectCache:
    """Host sources compiled with compile_command, each once per test session, as many at a time as there are cores:
    this file and test_npu_per_call_sync.py share them (tests/conftest.py `npu_objects`). A source that includes
    every header of PRECOMPILED itself, before any project header of its own is finished, gets them from the precompiled
    header (gcc -include, which then changes nothing but the time); any other source is compiled without it, so a
    missing #include still fails."""

    def __init__(self, out_dir):
        self._out_dir, self._done, self._lock = str(out_dir), {}, threading.Lock()
        self._pch_lock, self._pch = threading.Lock(), None

    def precompiled_header(self):
        """The header that includes PRECOMPILED, its .gch built next to it on first use."""
        with self._pch_lock:
            if self._pch is None:
                header = os.path.join(self._out_dir, "precompiled", "torch_headers.h")
                os.makedirs(os.path.dirname(header), exist_ok=True)
                with open(header, "w") as f:
                    f.write("".join(f"#include <{h}>\n" for h in PRECOMPILED))
                command = _without_output(compile_command(header, header + ".gch"))
                proc = subprocess.run(command[:1] + ["-x", "c++-header"] + command[1:] + ["-o", header + ".gch"],
                                      capture_output=True, text=True)
                assert proc.returncode == 0, f"the precompiled header does not build:\n{proc.stderr[-6000:]}"
                self._pch = header
            return self._pch

    def uses_precompiled(self, source):
        return precompiled_header_changes_nothing(include_tree(source), os.path.join(ROOT, "csrc") + os.sep)

    def compile(self, source, obj):
        """Compiles `source` into `obj` (the precompiled header only when the source includes its headers)."""
        command = compile_command(source, obj)
        if self.uses_precompiled(source):
            # -Winvalid-pch: a .gch that gcc cannot use says so (it would silently parse the headers again).
            command[1:1] = ["-Winvalid-pch", "-include", self.precompiled_header()]
        start = time.monotonic()
        proc = subprocess.run(command, capture_output=True, text=True)
        print(f"\n{os.path.relpath(source, ROOT)}: compiled in {time.monotonic() - start:.1f} s", file=sys.stderr)
        return Compiled(proc.returncode, proc.stderr, time.monotonic() - start, obj)

    def _compile(self, source):
        return self.compile(source, os.path.join(self._out_dir, os.path.basename(source) + ".o"))

    def get_all(self, sources):
        """Compiled results of `sources` (in order), compiling the ones not compiled yet in parallel."""
        assert shutil.which("g++"), "g++ is needed to compile the NPU host code"
        with self._lock:
            missing = [s for s in dict.fromkeys(sources) if s not in self._done]
            with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                for source, result in zip(missing, pool.map(self._compile, missing)):
                    self._done[source] = result
            return [self._done[s] for s in sources]


@pytest.fixture(scope="module")
def compiled(npu_objects):
    """source -> Compiled; every NPU host source is compiled on first use, in parallel."""
    npu_objects.get_all(NPU_SOURCES)
    return lambda source: npu_objects.get_all([source])[0]


def test_a_source_missing_an_include_fails_although_the_precompiled_header_has_it(npu_objects, tmp_path):
    # Negative control for the precompiled header: this source uses ATen without including it. Forced in, the
    # precompiled header would make it compile; the cache must not use it there.
    source = tmp_path / "forgot_aten.cpp"
    source.write_text("#include <string>\nat::Tensor twice(const at::Tensor& t) { return t + t; }\n")
    assert not npu_objects.uses_precompiled(str(source))
    result = npu_objects.compile(str(source), str(tmp_path / "forgot_aten.o"))
    assert result.returncode != 0 and "does not name a type" in result.stderr, result.stderr[-2000:]
    forced = compile_command(str(source), str(tmp_path / "forced.o"))
    forced[1:1] = ["-include", npu_objects.precompiled_header()]
    proc = subprocess.run(forced, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_precompiled_header_is_not_used_where_it_would_hide_a_header_missing_an_include(tmp_path):
    # A header of the project's own that uses ATen without including it, finished before ATen comes in.
    (tmp_path / "uses_aten.h").write_text("#pragma once\nat::Tensor twice(const at::Tensor& t);\n")
    heavy = "".join(f"#include <{h}>\n" for h in PRECOMPILED)
    header_first, header_last = tmp_path / "header_first.cpp", tmp_path / "header_last.cpp"
    header_first.write_text('#include "uses_aten.h"\n' + heavy)
    header_last.write_text(heavy + '#include "uses_aten.h"\n')
    root = str(tmp_path) + os.sep
    assert not precompiled_header_changes_nothing(include_tree(str(header_first)), root)
    assert precompiled_header_changes_nothing(include_tree(str(header_last)), root)


def test_there_are_npu_sources():
    assert len(NPU_SOURCES) >= 3, NPU_SOURCES


@pytest.mark.parametrize("source", NPU_SOURCES, ids=os.path.basename)
def test_compiles_against_torch_npu_headers(compiled, source):
    result = compiled(source)
    assert result.returncode == 0, f"{os.path.relpath(source, ROOT)} does not compile:\n{result.stderr[-8000:]}"
    own_warnings = [line for line in result.stderr.splitlines() if "warning:" in line and "csrc/" in line]
    assert not own_warnings, "warnings in project code:\n" + "\n".join(own_warnings)
    # The precompiled header, when given, was used (gcc would otherwise have parsed the headers again, silently).
    assert "-Winvalid-pch" not in result.stderr, result.stderr[-2000:]


def _symbols(path, defined):
    args = ["nm", "--defined-only" if defined else "--undefined-only"]
    if path.endswith(".so"):
        args.append("-D")
    proc = subprocess.run([*args, path], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in proc.stdout.splitlines() if line.strip()}


def _demangle(names):
    proc = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
    return dict(zip(names, proc.stdout.splitlines()))


def _strip_kind(demangled):
    """'typeinfo for c10d_npu::X' -> 'c10d_npu::X' (also vtable, VTT, guard variable)."""
    for kind in ("typeinfo for ", "typeinfo name for ", "vtable for ", "VTT for ", "guard variable for "):
        if demangled.startswith(kind):
            return demangled[len(kind):]
    return demangled


@pytest.fixture(scope="module")
def torch_npu_exports():
    library = os.path.join(TORCH_NPU_DIR, "lib", "libtorch_npu.so")
    if not os.path.isfile(library):
        pytest.skip(f"{library} not found: the torch-npu wheel's binary is needed to check the symbols")
    return _symbols(library, defined=True)


@pytest.mark.parametrize("source", NPU_SOURCES, ids=os.path.basename)
def test_torch_npu_symbols_exist_in_the_wheel(compiled, torch_npu_exports, source):
    result = compiled(source)
    assert result.returncode == 0, "does not compile (see test_compiles_against_torch_npu_headers)"
    undefined = sorted(_symbols(result.obj, defined=False))
    readable = _demangle(undefined)
    needed = [name for name in undefined if _strip_kind(readable[name]).startswith(TORCH_NPU_NAMESPACES)]
    missing = [readable[name] for name in needed if name not in torch_npu_exports]
    assert not missing, "not exported by libtorch_npu.so (wrong signature or ABI?):\n" + "\n".join(missing)
