"""Failure reporting (docs/decisions/0005-bounded-waits-and-failure-reporting.md) on the host side, without an NPU: the
logic that turns the kernels' ErrorRecord into an error raised once (csrc/host/common/kernel_error_watch.cpp, driven by
tests/kernel_errors/watch_main.cpp with fake records), the cap of TORCH_GEMM_AR_TIMEOUT_S below the AI Core kernel
timeout (common/kernel_timeout.h), and torch_gemm_ar.check_errors() / the check at interpreter exit
(torch_gemm_ar/errors.py) with a fake backend."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from error_codes import code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ERR_TIMEOUT_PREPARE = code("kErrTimeoutPrepare")
ERR_SIGNATURE_MISMATCH = code("kErrSignatureMismatch")
ERR_PEER_REJECTED = code("kErrPeerRejected")


@pytest.fixture(scope="module")
def watch(tmp_path_factory):
    if not shutil.which("g++"):
        pytest.skip("g++ is needed to build the error-record harness")
    binary = str(tmp_path_factory.mktemp("watch") / "watch")
    subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror",
                    "-I" + os.path.join(ROOT, "csrc", "include"), "-I" + os.path.join(ROOT, "csrc", "host"),
                    os.path.join(ROOT, "tests", "kernel_errors", "watch_main.cpp"),
                    os.path.join(ROOT, "csrc", "host", "common", "kernel_error_watch.cpp"), "-o", binary],
                   check=True)

    def run(*commands):
        proc = subprocess.run([binary], input="\n".join(commands) + "\n", capture_output=True, text=True,
                              check=True)
        return proc.stdout.splitlines()

    return run


def test_no_record_or_an_unwritten_one_raises_nothing(watch):
    out = watch("first 7", "call", "call", "record 0 3 1 2 -1", "record 2 0 1 2 -1")
    assert out == ["ok", "7", "8", "-", "-"]


def test_a_failure_is_raised_once_naming_call_group_rank_and_peer(watch):
    out = watch("first 4294967295", "call", "call", "call", f"record 2 {ERR_TIMEOUT_PREPARE} 1 2 -1",
                f"record 2 {ERR_TIMEOUT_PREPARE} 1 2 -1")
    assert out[1:4] == ["4294967295", "0", "1"]  # epochs wrap
    assert "call #2 on group 'tp' failed: rank 1 waited too long for rank 2 to start the call" in out[4]
    assert "NaN" in out[4] and "The group stays usable" in out[4]
    assert out[5] == "-", "the same record must not be raised twice"


def test_a_failure_of_a_call_the_host_did_not_count_is_still_raised(watch):
    # Call #5 was never queued eagerly here (2 calls): a call replayed from a captured graph took that epoch.
    out = watch("first 100", "call", "call", f"record 5 {ERR_TIMEOUT_PREPARE} 0 1 -1",
                f"record 5 {ERR_TIMEOUT_PREPARE} 0 1 -1")
    assert "a call (replayed from a captured graph" in out[3] and "rank 0 waited too long for rank 1" in out[3]
    assert out[4] == "-"


def test_a_rejection_the_rank_raised_itself_is_not_raised_again(watch):
    # Rank 0 rejected its arguments (host code 8): its host raised at the call, so its own kernel's record of it is
    # never raised again, whichever epoch the kernel ran with (call #5 was never counted here: a graph replay).
    out = watch("first 10", "call", f"record 1 {ERR_PEER_REJECTED} 0 0 8", f"record 5 {ERR_PEER_REJECTED} 0 0 8")
    assert out[-2:] == ["-", "-"]


def test_a_rejection_by_the_rank_s_own_kernel_is_raised(watch):
    # Word 0 = 1001 (kSignatureKernelRejected): the kernel, not the host, rejected the arguments; nobody raised it.
    out = watch("first 10", "call", f"record 1 {ERR_PEER_REJECTED} 0 0 1001")
    assert "rank 0 rejected its arguments" in out[-1], out


def test_a_peer_s_rejection_is_raised(watch):
    out = watch("first 10", "call", f"record 1 {ERR_PEER_REJECTED} 0 2 8")
    assert "rank 2 rejected its arguments" in out[-1], out


def test_signature_errors_are_worded_with_field_and_reason(watch):
    out = watch("first 1", "call", "call", f"record 1 {ERR_SIGNATURE_MISMATCH} 0 2 1",
                f"record 2 {ERR_PEER_REJECTED} 2 1 8")
    assert "rank 0 and rank 2 called with different M" in out[3]
    assert "rank 1 rejected its arguments (algorithm='fused' is not available there)" in out[4]


@pytest.mark.parametrize("requested_s,aicore_s,capped", [
    (300, 1091, 0),   # the default stays below the A2 default
    (2000, 1091, 1),  # above it: capped a tenth below it
    (100, 68, 1),     # the older training series' 68 s
    (5, 3, 1),        # a tiny timeout: the margin is at least 1 s
])
def test_timeout_is_capped_below_the_aicore_kernel_timeout(watch, requested_s, aicore_s, capped):
    wait_ms, was_capped = map(int, watch(f"bound {requested_s * 1000} {aicore_s * 1000}")[0].split())
    margin_ms = max(aicore_s * 1000 // 10, 1000)
    assert was_capped == capped
    assert wait_ms == (requested_s * 1000 if not capped else aicore_s * 1000 - margin_ms)
    assert wait_ms < aicore_s * 1000


def test_unknown_aicore_timeout_leaves_the_request_alone(watch):
    assert watch("bound 5000000 0") == ["5000000 0"]


def test_check_errors_runs_every_registered_checker_and_raises():
    import torch_gemm_ar
    from torch_gemm_ar import errors

    torch_gemm_ar.check_errors()  # no NPU backend here: nothing registered that could fail
    pending = ["call #3 on group 'tp' failed: rank 1 waited too long for rank 2"]

    def fake_backend():  # reports a pending failure once, as the NPU checker does
        if pending:
            raise RuntimeError(pending.pop())

    errors.register_error_checker(fake_backend)
    try:
        with pytest.raises(RuntimeError, match="call #3 on group 'tp' failed"):
            torch_gemm_ar.check_errors()
        torch_gemm_ar.check_errors()  # reported already: quiet
    finally:
        errors._checkers.remove(fake_backend)


@pytest.mark.parametrize("reported", [False, True])
def test_an_unreported_failure_is_raised_at_interpreter_exit(tmp_path, reported):
    script = textwrap.dedent(f"""
        import torch_gemm_ar
        from torch_gemm_ar import errors
        pending = ["call #1 on group 'tp' failed: rank 0 and rank 1 called with different M"]
        def fake_backend():
            if pending:
                raise RuntimeError(pending.pop())
        errors.register_error_checker(fake_backend)
        if {reported}:
            try:
                torch_gemm_ar.check_errors()
            except RuntimeError:
                pass
        print("main done")
    """)
    # From another directory: the installed package, not the source tree (which has no built extension).
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=str(tmp_path))
    assert "main done" in proc.stdout, proc.stderr
    if reported:
        assert "never reported" not in proc.stderr, proc.stderr
        assert proc.returncode == 0, f"exit status {proc.returncode} although the failure was reported: {proc.stderr}"
    else:
        assert "a failed call was never reported before exit: call #1 on group 'tp' failed" in proc.stderr
        # A batch job must see the failure in its exit status too, not only in the log.
        assert proc.returncode == 1, f"exit status {proc.returncode} with an unreported failure: {proc.stderr}"


@pytest.mark.parametrize("code,words", [(20, "waited too long for rank 2's rows 3 of a"),
                                        (21, "waited too long for rank 2 to finish reading its shard")],
                         ids=["rows", "consumed"])
def test_sequence_parallel_kernel_failures_are_named(watch, code, words):
    # gemm_ar::kErrTimeoutRows / kErrTimeoutConsumed, recorded by the allgather_gemm kernels
    # (docs/decisions/0010-sequence-parallel-ops.md).
    out = watch("first 4", "call", f"record 1 {code} 1 2 3")
    assert words in out[2] and "NaN" in out[2], out
