"""The Ascend kernels (csrc/kernels) built the way the device compiler sees them, by g++ and by clang++: -O2 with
strict aliasing, scalar GM accesses as plain volatile loads and stores (-DGEMM_AR_PLAIN_SCALARS: no simulator cache
model, no negative controls), warnings that point at miscompiled device code as errors. Then the real
load_kernel_args, compiled the same way, must hand the kernel code every KernelArgs field the host wrote
(tests/kernels_sim/args_load_check.cpp): a struct filled through a pointer of another type lets the optimiser keep
a field's earlier value (the zeroes of `KernelArgs args{}`).

Builds:
  - "g++ c++17" and "clang++ c++17": C++17 as the device compiler takes it (-pedantic-errors: no C++20 extension
    slips through), against tests/kernels_sim/device_api_stub, because pto-isa's CPU headers need C++20 (its
    README; pto/cpu/trace.hpp uses std::remove_cvref_t and requires-expressions, TFillPad.hpp, TQuant.hpp and
    SetQuantScalar.hpp std::bit_cast, TBinSOps.hpp and NPUMemoryModel.hpp C++20's implicit typename). Needs no
    PTO_ISA_ROOT.
  - "g++ c++20 pto-isa": against pto-isa's real CPU headers (as tests/kernel_sim_build.py, which patches one header
    for g++ 12), so the plain-scalar code is also checked against the library's own declarations. Skips without
    PTO_ISA_ROOT. Debian's clang 14 cannot compile those headers (no _Float16 on x86-64 before clang 15, no implicit
    typename before clang 16), hence g++ only.

Negative control: -DGEMM_AR_CONTROL_PUNNED_ARGS_LOAD (a test-build-only macro) restores the old fill of KernelArgs
through a uint64_t*. Seen here: g++ 12 rejects it at compile time (-Wstrict-aliasing=1 as an error; at run time its
reads come out right because the compiler barriers around the invalidate happen to stop it from forwarding the
zeroes), clang++ 14 compiles it and its reads of 32-bit and float fields come out as the zeroes or garbage (clang
has no -Wstrict-aliasing). CI (CI=true) must have clang++: .ci/run installs it; the clang builds fail there instead
of skipping."""
import concurrent.futures
import os
import re
import shutil
import subprocess
import tempfile

import pytest

import kernel_sim_build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = [os.path.join(ROOT, "csrc", "kernels", name + ".cpp")
           for name in ("gemm_compute_kernel", "gemm_comm_kernel", "sp_compute_kernel", "sp_comm_kernel")]
HARNESS = os.path.join(ROOT, "tests", "kernels_sim", "args_load_check.cpp")
STUB = os.path.join(ROOT, "tests", "kernels_sim", "device_api_stub")
CONTROL = "-DGEMM_AR_CONTROL_PUNNED_ARGS_LOAD"

# Both compilers: the device configuration, every usual warning, and the ones that mean miscompiled device code as
# errors (an uninitialised read of KernelArgs is what g++ reports when it cannot see a punned fill).
COMMON_FLAGS = ["-O2", "-fstrict-aliasing", "-D__CPU_SIM", "-DGEMM_AR_PLAIN_SCALARS", "-Wall", "-Wextra",
                "-pedantic-errors", "-Werror=uninitialized"]
# Level 1 is g++'s widest type-pun check and quiet on the clean kernels; clang accepts -Wstrict-aliasing but does
# not implement it. g++'s -Wcast-align warns only on strict-alignment targets (=strict also flags the legitimate
# byte-address-to-word casts of GM), clang's skips casts from byte pointers: there it is meaningful.
COMPILER_FLAGS = {
    # -Werror=strict-aliasing first: it turns the check on at level 3, the level given after it wins
    "g++": ["-Werror=strict-aliasing", "-Wstrict-aliasing=1", "-Werror=maybe-uninitialized",
            "-Werror=class-memaccess"],
    "clang++": ["-Werror=sometimes-uninitialized", "-Werror=cast-align"],
}
BUILDS = ["g++ c++17", "clang++ c++17", "g++ c++20 pto-isa"]
JOBS = 2


def _unavailable(build):
    """Why `build` cannot run here, or None."""
    cxx = build.split()[0]
    if shutil.which(cxx) is None:
        return f"{cxx} is not installed"
    if "pto-isa" in build and not os.environ.get("PTO_ISA_ROOT"):
        return "PTO_ISA_ROOT is unset (a checkout of pto-isa's headers; docs/ascend.md, \"Tests\")"
    return None


def _flags(build, tmp):
    cxx = build.split()[0]
    flags = COMMON_FLAGS + COMPILER_FLAGS[cxx]
    if "pto-isa" in build:
        pto = os.environ["PTO_ISA_ROOT"]
        return flags + ["-std=c++20", "-DPTO_CPU_MAX_THREADS=1", "-include", "stdint.h", "-include", "stddef.h",
                        "-include", "pto/pto-inst.hpp", "-isystem", kernel_sim_build._patched_include_dir(tmp),
                        "-isystem", os.path.join(pto, "include"),
                        "-I" + os.path.join(ROOT, "csrc", "include"), "-I" + os.path.join(ROOT, "csrc", "kernels")]
    return flags + ["-std=c++17", "-isystem", STUB, "-I" + os.path.join(ROOT, "csrc", "include"),
                    "-I" + os.path.join(ROOT, "csrc", "kernels")]


def _compile(cmd):
    done = subprocess.run(cmd, capture_output=True, text=True)
    return done.returncode, done.stderr


@pytest.fixture(scope="module")
def device_builds():
    """Every available build compiled once, JOBS compiles at a time: {build: {"skip": reason} or {"kernels":
    {source: (rc, stderr)}, "harness": (rc, stderr, binary), "control": (rc, stderr, binary)}}."""
    tmp = tempfile.mkdtemp(prefix="gemm_ar_device_build_")
    results, pending = {}, {}
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=JOBS) as pool:
            for build in BUILDS:
                reason = _unavailable(build)
                if reason is not None:
                    results[build] = {"skip": reason}
                    continue
                cxx, flags = build.split()[0], _flags(build, tmp)
                tag = re.sub(r"[^a-z0-9]+", "_", build)
                results[build] = {"kernels": {}}
                for src in KERNELS:
                    obj = os.path.join(tmp, f"{tag}_{os.path.basename(src)}.o")
                    pending[pool.submit(_compile, [cxx] + flags + ["-c", src, "-o", obj])] = (build, "kernels", src)
                for kind, extra in (("harness", []), ("control", [CONTROL])):
                    binary = os.path.join(tmp, f"{tag}_{kind}")
                    cmd = [cxx] + flags + extra + [HARNESS, "-o", binary, "-pthread"]
                    pending[pool.submit(_compile, cmd)] = (build, kind, binary)
            for future, (build, kind, what) in pending.items():
                rc, stderr = future.result()
                if kind == "kernels":
                    results[build]["kernels"][what] = (rc, stderr)
                else:
                    results[build][kind] = (rc, stderr, what)
        yield results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _usable(results, build):
    """The results of `build`; skips (with the reason) when it cannot run here, fails when CI lacks clang++."""
    reason = results[build].get("skip")
    if reason is not None:
        if build.startswith("clang++") and os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {reason}: .ci/run installs Debian's clang package")
        pytest.skip(reason)
    return results[build]


def _run_harness(binary):
    done = subprocess.run([binary], capture_output=True, text=True, timeout=60)
    mismatches = [line for line in done.stdout.splitlines() if line.startswith("mismatch ")]
    return done.returncode, done.stdout + done.stderr, mismatches


@pytest.mark.parametrize("build", BUILDS)
def test_kernels_compile_device_like(device_builds, build):
    res = _usable(device_builds, build)
    failed = {os.path.basename(src): stderr for src, (rc, stderr) in res["kernels"].items() if rc != 0}
    assert not failed, "\n".join(f"--- {name} ({build}):\n{stderr[-4000:]}" for name, stderr in failed.items())


@pytest.mark.parametrize("build", BUILDS)
def test_kernel_args_load_reads_every_field(device_builds, build):
    res = _usable(device_builds, build)
    rc, stderr, binary = res["harness"]
    assert rc == 0, f"compiling args_load_check.cpp ({build}) failed:\n{stderr[-4000:]}"
    code, output, mismatches = _run_harness(binary)
    assert code == 0 and not mismatches, f"{build}: load_kernel_args lost fields:\n{output[-4000:]}"
    assert re.search(r"checked \d+ fields in 2 cases, 0 mismatches", output), output


def test_punned_args_load_is_caught(device_builds):
    """The old KernelArgs fill through a uint64_t* must fail at least one build: by a -Wstrict-aliasing (or
    uninitialised-read) error or by a wrong field at run time. Which build caught it how is in the message."""
    outcomes, runtime_catches = {}, 0
    for build in BUILDS:
        res = device_builds[build]
        if "skip" in res:
            if build.startswith("clang++") and os.environ.get("CI") == "true":
                pytest.fail(f"CI=true but {res['skip']}: .ci/run installs Debian's clang package")
            outcomes[build] = f"not run ({res['skip']})"
            continue
        rc, stderr, binary = res["control"]
        if rc != 0:
            errors = sorted(set(re.findall(r"error: .*?\[-Werror=([a-z-]+)\]", stderr)))
            assert errors, f"{build}: the control build failed for another reason than a warning:\n{stderr[-3000:]}"
            outcomes[build] = "compile error (-W" + ", -W".join(errors) + ")"
            continue
        code, output, mismatches = _run_harness(binary)
        if mismatches:
            runtime_catches += 1
            outcomes[build] = f"compiled; {len(mismatches)} wrong fields at run time, e.g. {mismatches[0]!r}"
        else:
            outcomes[build] = f"compiled; all fields right at run time (exit {code}): not caught"
    summary = "; ".join(f"{build}: {outcome}" for build, outcome in outcomes.items())
    print("negative control (punned KernelArgs load):", summary)
    assert any(o.startswith("compile error") or "wrong fields" in o for o in outcomes.values()), summary
    # The field check itself must be able to fail: clang++ is the compiler that reads the zeroes back.
    if "skip" not in device_builds["clang++ c++17"]:
        assert runtime_catches > 0, "no build read a wrong field at run time: " + summary
