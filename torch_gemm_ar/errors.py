"""Failures of calls whose kernels run asynchronously (docs/decisions/0005-bounded-waits-and-failure-reporting.md;
docs/ascend.md, "Errors").

A fused NPU call returns as soon as its kernels are queued; if they fail (a peer that never came, ranks that called
with different shapes), the call's output holds NaN and the failure is raised by the next call on that group, by
`check_errors()`, or, if neither happened, when the interpreter exits. Backends register a checker here.
"""
import atexit
import os
import sys
import threading

_checkers = []
_lock = threading.Lock()


def register_error_checker(check):
    """`check()` waits for the backend's queued work and raises RuntimeError for a failure not reported yet."""
    with _lock:
        if check not in _checkers:
            _checkers.append(check)


def check_errors():
    """Waits for every fused call queued so far (a device synchronisation) and raises RuntimeError naming the
    group, the call and the rank for the first failure that was not reported yet. A no-op without such backends."""
    with _lock:
        checkers = list(_checkers)
    for check in checkers:
        check()


def _check_at_exit():
    try:
        check_errors()
    except Exception as error:  # noqa: BLE001  (every failure must be shown, whatever its type)
        sys.stderr.write(f"torch_gemm_ar: a failed call was never reported before exit: {error}\n")
        # An exception in an atexit callback is printed but leaves the exit status at 0, so a batch job would pass.
        # Exit with status 1 instead (the exit callbacks registered before this module's import are skipped; logging,
        # the usual one, is flushed here).
        if "logging" in sys.modules:
            sys.modules["logging"].shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


atexit.register(_check_at_exit)
