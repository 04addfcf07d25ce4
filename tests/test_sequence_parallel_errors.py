"""Bad input to gemm_reduce_scatter / allgather_gemm raises an error naming the argument on every rank, ranks that
disagree raise everywhere (never a hang), and the group stays usable."""
import pytest
import torch

import torch_gemm_ar
from expect import raises

rs, ag = torch_gemm_ar.gemm_reduce_scatter, torch_gemm_ar.allgather_gemm


def every_rank_bad(rank, world):
    a, b = torch.randn(4 * world, 5), torch.randn(5, 3)
    if world > 1:
        raises(lambda: rs(torch.randn(4 * world + 1, 5), b), "gemm_reduce_scatter", "scatter_dim=0",
               f"{4 * world + 1}", "not divisible by the world size", exc=ValueError)
        raises(lambda: rs(torch.randn(2, 4 * world + 1, 5), b, scatter_dim=1), "scatter_dim=1",
               "not divisible", exc=ValueError)
    for op, arg in ((rs, "scatter_dim"), (ag, "gather_dim")):
        name = "gemm_reduce_scatter" if op is rs else "allgather_gemm"
        raises(lambda: op(a, b, **{arg: 1}), f"{name}: {arg}=1", "row dim", exc=ValueError)
        raises(lambda: op(a, b, **{arg: -1}), f"{arg}=-1", exc=ValueError)
        raises(lambda: op(torch.randn(2, 2 * world, 5), b, **{arg: 2}), f"{arg}=2", exc=ValueError)
        raises(lambda: op(a, torch.randn(4, 3)), f"{name}: ", "K=5", "K=4", exc=ValueError)
        raises(lambda: op(a, b, bias=torch.randn(4)), "bias must be 1-D [N]", exc=ValueError)
        raises(lambda: op(a.int(), b.int()), "Int", "supported", exc=ValueError)
        raises(lambda: op(a, b, algorithm="fastest"), "algorithm must be one of", exc=ValueError)
        raises(lambda: torch.ops.pto.gemm_reduce_scatter(a, b, "no-such-group"), "group_name 'no-such-group'")
        if world > 1:
            raises(lambda: op(a, b, algorithm="chunked"), "chunked", "not available", exc=ValueError)
    # Still usable after all of that.
    assert rs(a, b).shape == (4, 3)
    assert rs(a, b, algorithm="fused").shape == (4, 3)
    assert ag(a, b, algorithm="fused").shape == (4 * world * world, 3)
    assert ag(a, b).shape == (4 * world * world, 3)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bad_arguments_on_every_rank(ranks, world):
    ranks(world).run(every_rank_bad)


def one_rank_differs(rank, world, op_name, case, algorithm="auto"):
    op = rs if op_name == "rs" else ag
    dim_arg = "scatter_dim" if op_name == "rs" else "gather_dim"
    a, b, bias = torch.randn(2, 2 * world, 5), torch.randn(5, 3), torch.randn(3)
    kwargs = {dim_arg: 1, "bias": bias}
    other = rank == 1
    if case == "dim" and other:
        a = torch.randn(2 * world, 2 * world, 5)
        kwargs[dim_arg] = 0
    if case == "M" and other:
        a = torch.randn(2, 4 * world, 5)
    if case == "layout" and other:  # the same M, split differently between the dims before K
        a = torch.randn(4, world, 5)
    if case == "dtype" and other:
        a, b, kwargs["bias"] = a.double(), b.double(), bias.double()
    if case == "bias-bad" and other:
        kwargs["bias"] = torch.randn(4)
    if case == "bias-missing" and other:
        kwargs["bias"] = None
    if case == "op" and other:  # rank 1 calls the other op with an otherwise identical signature
        op = ag if op is rs else rs
        kwargs = {("gather_dim" if dim_arg == "scatter_dim" else "scatter_dim"): 1, "bias": bias}
    with pytest.raises(ValueError) as info:
        op(a, b, algorithm=algorithm, **kwargs)
    message = str(info.value)
    if case == "bias-bad":
        assert ("bias must be 1-D" in message) if other else ("another rank rejected" in message), message
    else:
        assert "disagree" in message and "rank 1" in message, message
    # The group is still usable afterwards.
    out = rs(torch.ones(world, 5), torch.ones(5, 3))
    torch.testing.assert_close(out, torch.full((1, 3), 5.0 * world))
    return message


@pytest.mark.parametrize("algorithm", ["auto", "fused"])
@pytest.mark.parametrize("op_name", ["rs", "ag"])
@pytest.mark.parametrize("case", ["dim", "M", "layout", "dtype", "bias-bad", "bias-missing", "op"])
def test_ranks_that_disagree_raise_everywhere(ranks, op_name, case, algorithm):
    messages = ranks(3).run(one_rank_differs, op_name, case, algorithm, timeout_s=60)
    assert all(messages), messages
    if case == "layout":
        assert all("rows per chunk" in m for m in messages), messages


def late_peer(rank, world, op_name):
    """Rank 1 never joins a fused call of `op_name`: rank 0's bounded wait must raise naming that op (errors deep in
    the engine name the op that failed). Rank 1 then joins the same call, which fails on its side too."""
    import time

    from scoped_env import scoped_env

    op = getattr(torch_gemm_ar, op_name)
    a, b = torch.randn(4 * world, 8), torch.randn(8, 16)
    with scoped_env(TORCH_GEMM_AR_TIMEOUT_S="1"):
        torch.distributed.barrier()
        if rank == 1:
            time.sleep(3)
        try:
            op(a, b, algorithm="fused")
        except (RuntimeError, ValueError) as e:
            return str(e)
    return None


@pytest.mark.parametrize("op_name", ["gemm_reduce_scatter", "allgather_gemm"])
def test_engine_errors_name_the_op(ranks, op_name):
    from rank_pool import RankFailure

    pool = ranks(2)
    try:
        messages = pool.run(late_peer, op_name, timeout_s=120)
    except RankFailure as failure:  # rank 1 may also see rank 0 give up first: only rank 0's text is checked below
        raise AssertionError(f"a rank did not return its error: {failure}") from None
    finally:
        pool.close(force=True)  # the group saw a timed-out call: later tests get fresh ranks
    assert messages[0] is not None and messages[0].startswith(f"{op_name}: "), messages
    assert "gemm_allreduce:" not in messages[0], messages
