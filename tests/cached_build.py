"""Test-side builds kept under build/tests/<name>-<hash of their inputs>: built once per change of their sources
(a lock keeps two test processes from building the same one at once), reused by later sessions."""
import fcntl
import hashlib
import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def inputs_hash(paths):
    """A hash of the files under `paths` (files or directories, relative to the repository root)."""
    digest = hashlib.sha256()
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


def cached_build(name, input_paths, build):
    """The directory holding `name`'s build for the current inputs; `build(directory)` fills a fresh one when there
    is none yet (raising on failure, which leaves nothing behind)."""
    base = os.path.join(ROOT, "build", "tests")
    os.makedirs(base, exist_ok=True)
    target = os.path.join(base, f"{name}-{inputs_hash(input_paths)}")
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
    return target
