"""Bad input gets an error that names the argument, on every rank, and never a hang; the group stays usable."""
import pytest
import torch

import torch_gemm_ar
from expect import raises


def every_rank_bad(rank, world):
    a, b = torch.randn(8, 5), torch.randn(5, 3)
    g = torch_gemm_ar.gemm_allreduce
    raises(lambda: g(torch.randn(5), b), "a must be 2-D", "[5]")
    raises(lambda: g(torch.randn(2, 2, 2, 5), b), "a must be 2-D")
    raises(lambda: g(a, torch.randn(5)), "b must be 2-D")
    raises(lambda: g(a, torch.randn(4, 3)), "K=5", "K=4")
    raises(lambda: g(a, b, bias=torch.randn(4)), "bias must be 1-D [N]", "N=3")
    raises(lambda: g(a, b, bias=torch.randn(3, 1)), "bias must be 1-D")
    raises(lambda: g(a, b, bias=torch.randn(3, dtype=torch.float64)), "bias must have the dtype")
    raises(lambda: g(a, b.double()), "same dtype", "Float", "Double")
    raises(lambda: g(a.long(), b.long()), "Long", "supported")
    raises(lambda: g(a.int(), b.int()), "Int", "supported")
    raises(lambda: g(a, b, algorithm="fastest"), "algorithm must be one of", "fastest")
    raises(lambda: torch.ops.pto.gemm_allreduce(a, b, "no-such-group"), "group_name 'no-such-group'")
    raises(lambda: torch_gemm_ar.gemm_allreduce(a, b, group=3), "group must be a ProcessGroup", exc=TypeError)
    # Every wrapper's group error names its op.
    for name in ("gemm_allreduce", "gemm_reduce_scatter", "allgather_gemm"):
        raises(lambda: getattr(torch_gemm_ar, name)(a, b, group=3), f"{name}: group must be", exc=TypeError)
    # Still usable after all of that.
    out = g(a, b, algorithm="sequential")
    assert out.shape == (8, 3)


@pytest.mark.parametrize("world", [1, 2])
def test_bad_arguments_on_every_rank(ranks, world):
    ranks(world).run(every_rank_bad)


def one_rank_bad(rank, world, case, algorithm):
    a, b = torch.randn(8, 5), torch.randn(5, 3)
    bias = torch.randn(3)
    kwargs = {}
    if case == "bias" and rank == 1:
        bias = torch.randn(4)
    if case == "K" and rank == 1:
        a, b = torch.randn(8, 6), torch.randn(6, 3)
    if case == "N" and rank == 1:
        b, bias = torch.randn(5, 4), torch.randn(4)
    if case == "M" and rank == 1:
        a = torch.randn(9, 5)
    if case == "M-big" and rank == 1:  # this rank alone would grow the fused engine's windows
        a = torch.randn(3000, 5)
    if case == "dtype" and rank == 1:
        a, b, bias = a.bfloat16(), b.bfloat16(), bias.bfloat16()
    if case == "algorithm" and rank == 1:
        kwargs["algorithm"] = "sequential"
    if case == "bias-missing" and rank == 1:
        bias = None
    with pytest.raises(ValueError) as info:
        torch_gemm_ar.gemm_allreduce(a, b, bias=bias, algorithm=kwargs.get("algorithm", algorithm))
    message = str(info.value)
    if case == "bias":
        assert ("bias must be 1-D" in message) if rank == 1 else ("rank 1" in message and "bias" in message), message
    elif case != "bias-missing":
        assert "disagree" in message and "rank 1" in message, message
    # The group is still usable afterwards, with the same algorithm.
    out = torch_gemm_ar.gemm_allreduce(torch.ones(2, 5), torch.ones(5, 3), algorithm=algorithm)
    torch.testing.assert_close(out, torch.full((2, 3), 5.0 * world))
    return message


@pytest.mark.parametrize("algorithm", ["chunked", "fused"])
@pytest.mark.parametrize("case", ["bias", "K", "N", "M", "M-big", "dtype", "algorithm", "bias-missing"])
def test_ranks_that_disagree_raise_everywhere(ranks, case, algorithm):
    messages = ranks(3).run(one_rank_bad, case, algorithm, timeout_s=60)
    assert all(messages), messages


def mixed_devices(rank, world):
    a, b = torch.randn(8, 5), torch.randn(5, 3, device="meta")
    with pytest.raises(Exception, match="device"):
        torch_gemm_ar.gemm_allreduce(a, b)


def test_mixed_devices(ranks):
    ranks(2).run(mixed_devices)


def test_no_process_group_initialized():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this process already has a default group")
    with pytest.raises(RuntimeError, match="init_process_group"):
        torch_gemm_ar.gemm_allreduce(torch.randn(2, 2), torch.randn(2, 2))


def rejections_in_a_row(rank, world, op, skip_previous_call_wait=False):
    """The last rank passes a `b` of the wrong K three calls in a row, then every rank calls correctly. Rank 0 enters
    each call late, so the rejecting rank (which leaves a rejected call at once) runs ahead of it. Returns each
    rank's error types and messages."""
    import time

    from hooked_build import hooked

    fn = getattr(torch_gemm_ar, op)
    a = torch.ones(4 * world, 8)
    errors = []
    with hooked("skip_previous_call_wait", skip_previous_call_wait):
        for _ in range(3):
            if rank == 0:
                time.sleep(0.2)
            b = torch.ones(9 if rank == world - 1 else 8, 5)
            try:
                fn(a, b)
            except (ValueError, RuntimeError) as e:
                errors.append((type(e).__name__, str(e)))
            else:
                errors.append((None, "no error"))
        out = fn(a, torch.ones(8, 5))
    out = out[0] if isinstance(out, tuple) else out
    assert bool((out == out.flatten()[0]).all()) and float(out.flatten()[0]) in (8.0, 8.0 * world), out
    return errors


@pytest.mark.parametrize("world,op", [(2, "allgather_gemm"), (3, "gemm_allreduce"), (2, "gemm_reduce_scatter")])
def test_a_rank_that_keeps_rejecting_its_arguments_gets_value_errors_everywhere(ranks, world, op):
    """Every rank raises a ValueError each time, its peers naming the rejecting rank: the rejecting rank publishes
    its next call's header only once every peer has started the previous one (the header keeps two calls)."""
    for rank, errors in enumerate(ranks(world).run(rejections_in_a_row, op, timeout_s=120)):
        for kind, message in errors:
            assert kind == "ValueError", (rank, errors)
            assert ("K=9" if rank == world - 1 else f"rank {world - 1}") in message, (rank, message)


def test_negative_control_rejections_in_a_row_without_the_wait(hooked_ranks):
    """Without the wait the rejecting rank overwrites its header of a call rank 0 has not read yet: rank 0 then
    sees an abandoned call (a RuntimeError that names no argument) instead of the rejection."""
    pool = hooked_ranks(2)
    try:
        errors = pool.run(rejections_in_a_row, "allgather_gemm", True, timeout_s=120)
    finally:
        pool.close(force=True)
    assert any(kind == "RuntimeError" and "abandoned" in message for kind, message in errors[0]), errors[0]
