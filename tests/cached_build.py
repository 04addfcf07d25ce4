"""Test-side builds kept under build/tests/<name>-<hash of their inputs>: built once per change of their sources or
toolchain (Python, torch, compiler; a lock keeps two test processes from building the same one at once), reused by
later sessions; a new build removes the older ones. `rm -rf build/tests` forces a rebuild."""
import fcntl
import hashlib
import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def root_script(name):
    """Imports the repository-root script `name`.py (build_npu, ...) by its path. Never by putting the root on sys.path:
    that would shadow the installed torch_gemm_ar (no compiled _C in a clean clone) in this process and every rank
    it spawns."""
    import importlib.util
    import sys

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def toolchain():
    """What a build also depends on besides its sources: Python, torch and the C++ compiler."""
    import platform
    import subprocess

    import torch

    cxx = os.environ.get("CXX", "g++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except OSError:
        version = "none"
    return f"{platform.python_version()}|{torch.__version__}|{cxx}|{version.splitlines()[:1]}"


def inputs_hash(paths, flags=""):
    """A hash of the files under `paths` (files or directories, relative to the repository root), the toolchain and
    `flags` (compiler flags from the environment)."""
    digest = hashlib.sha256((toolchain() + "|" + flags).encode())
    files = []
    for path in paths:
        full = os.path.join(ROOT, path)
        if os.path.isdir(full):
            for base, _, names in os.walk(full):
                files += [os.path.join(base, n) for n in names if n.endswith((".cpp", ".h", ".hpp", ".py"))]
        else:
            files.append(full)
    for f in sorted(files):
        digest.update(os.path.relpath(f, ROOT).encode())
        with open(f, "rb") as fh:
            digest.update(fh.read())
    return digest.hexdigest()[:16]


def cached_build(name, input_paths, build, flags=""):
    """The directory holding `name`'s build for the current inputs (and `flags`); `build(directory)` fills a fresh one
    when there is none yet (raising on failure, which leaves nothing behind)."""
    base = os.path.join(ROOT, "build", "tests")
    os.makedirs(base, exist_ok=True)
    target = os.path.join(base, f"{name}-{inputs_hash(input_paths, flags)}")
    with open(os.path.join(base, f"{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(target):
            partial = target + ".partial"
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
            try:
                build(partial)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
            os.rename(partial, target)
            for old in os.listdir(base):  # builds of older sources or toolchains
                path = os.path.join(base, old)
                if old.startswith(name + "-") and path != target and os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
    return target
