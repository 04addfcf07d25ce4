"""The test build of torch_gemm_ar._C: the product's sources compiled with TORCH_GEMM_AR_TEST_HOOKS, so that the
negative controls' faults (csrc/host/common/test_hooks.h) and their bindings exist (docs/decisions/0015-test-hooks.md).
Rank processes of a `hooked_ranks` pool (tests/conftest.py) load it as torch_gemm_ar._C before importing
torch_gemm_ar; the product's own _C is never replaced in the test session's main process."""
import contextlib
import functools
import glob
import importlib.util
import os
import re
import subprocess
import sys

from cached_build import ROOT, cached_build

INPUTS = ["csrc", "setup.py", "build_npu.py"]


def _build(directory):
    env = dict(os.environ, TORCH_GEMM_AR_BUILD_TEST_HOOKS="1")
    cmd = [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", directory,
           "--build-temp", os.path.join(ROOT, "build", "tests", "test-hooks-objects")]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"building the test build failed:\n{' '.join(cmd)}\n{result.stdout[-3000:]}"
                           f"\n{result.stderr[-6000:]}")


def hooked_extension_path():
    """The test build's _C shared object, built for the current sources if needed (about a minute on 2 cores)."""
    directory = cached_build("test-hooks", INPUTS, _build)
    (path,) = glob.glob(os.path.join(directory, "torch_gemm_ar", "_C*.so"))
    return path


def load_as_torch_gemm_ar_c(path):
    """Makes `path` the torch_gemm_ar._C of this process: call before torch_gemm_ar is imported."""
    if "torch_gemm_ar" in sys.modules:
        raise RuntimeError("torch_gemm_ar is already imported in this process: the test build must come first")
    import torch  # noqa: F401  (libtorch before the extension)

    spec = importlib.util.spec_from_file_location("torch_gemm_ar._C", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["torch_gemm_ar._C"] = module
    if not module._test_build:
        raise RuntimeError(f"{path} is not the test build")


@functools.lru_cache(maxsize=None)
def harmless_values():
    """{hook: its harmless value}, read from GEMM_AR_TEST_HOOK_LIST in csrc/host/common/test_hooks.h (the product has
    no hooks to ask)."""
    text = open(os.path.join(ROOT, "csrc", "host", "common", "test_hooks.h")).read()
    values = {}
    for kind, name, harmless in re.findall(r"X\((bool|int64_t), (\w+), (-?\w+),", text):
        values[name] = (harmless == "true") if kind == "bool" else int(harmless)
    return values


@contextlib.contextmanager
def hooked(name, value):
    """A test hook set for the length of a `with` block (restored after). Needs the test build (a `hooked_ranks` pool)
    unless `value` is the hook's harmless value: then the product, which has no hooks, runs as it is."""
    from torch_gemm_ar import _C

    harmless = harmless_values()
    if name not in harmless:
        raise ValueError(f"no test hook {name!r} in csrc/host/common/test_hooks.h; the hooks: {sorted(harmless)}")
    if not _C._test_build:
        if value != harmless[name]:
            raise RuntimeError(f"the test hook {name!r} exists only in the test build: use the hooked_ranks fixture")
        yield
        return
    previous = _C._set_test_hook(name, value)
    try:
        yield
    finally:
        _C._set_test_hook(name, previous)
