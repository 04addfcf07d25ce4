"""Assertions shared by the error tests."""
import pytest


def raises(fn, *fragments, exc=Exception):
    """Runs fn, which must raise `exc` with every fragment in its message; returns the message."""
    with pytest.raises(exc) as info:
        fn()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"expected {fragment!r} in the error: {message}"
    return message


def error_of_a_fused_call_with(option, value, env, a_shape, b_shape):
    """One fused gemm_allreduce of random a_shape x b_shape inputs under the environment `env`, with an engine option
    (by name, or a `_C._set_*` setter: scoped_env.engine_switch) set to `value`, restored after. Ranks pass values
    that differ; returns the call's ValueError message, or "" if the call passed."""
    import torch
    import torch_gemm_ar
    from scoped_env import engine_switch

    try:
        with engine_switch(option, value, **env):
            torch_gemm_ar.gemm_allreduce(torch.randn(*a_shape), torch.randn(*b_shape), algorithm="fused")
    except ValueError as e:
        return str(e)
    return ""


def seconds_until_raised_within_probe_bound(rank, failing, convert, failing_raises, waiting_raises):
    """Runs a converter call `convert()` under a 3 s probe bound (TORCH_GEMM_AR_PROBE_TIMEOUT_S) where a probed
    layer fails on rank `failing` only: there it must raise `failing_raises`, elsewhere `waiting_raises` (each an
    exception class followed by fragments of its message). Returns this rank's seconds until it raised."""
    import time
    from scoped_env import scoped_env

    start = time.monotonic()
    with scoped_env(TORCH_GEMM_AR_PROBE_TIMEOUT_S="3"):
        exc, *fragments = failing_raises if rank == failing else waiting_raises
        raises(convert, *fragments, exc=exc)
    return time.monotonic() - start
