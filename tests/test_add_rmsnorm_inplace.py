"""gemm_allreduce_add_rmsnorm_ (the in-place variant, docs/decisions/0011-add-rmsnorm-epilogue.md) on real rank
processes: `residual` ends up holding the new residual stream and the returned `normed` is the norm, both bitwise what
the out-of-place op returns and within tolerance of float64 (world sizes 1-4, odd shapes, 3-D, bias, fp32/bf16/fp64,
every algorithm, the owner-last walk on and off); residuals that are views of a wider buffer; residuals that overlap an
input and inputs that require grad are refused on every rank; torch.compile; a negative control (the engine overwriting
the residual instead of adding into it) that the checks must catch."""
import random

import pytest
import torch
import torch.distributed as dist

import torch_gemm_ar
from expect import raises
from hooked_build import hooked
from inputs import ODD_SHAPES, TOLERANCE, assert_matches, digest
from test_add_rmsnorm import compile_step_inputs, odd_case, rms_norm64
from torch_gemm_ar import _C


def in_place_matches_out_of_place(rank, world, seed, algorithm, dtype, owner_last=True, strided=False):
    previous = _C._set_engine_option("owner_last", owner_last)
    digests = []
    eps = 1e-5
    try:
        for case, (m, k, n) in enumerate(ODD_SHAPES):
            shards, b, bias, ref_sum, original, w, (with_bias, _, three_d) = odd_case(seed, case, world, dtype)
            want_out, want_normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm(shards[rank], b, original, w, eps=eps,
                                                                             bias=bias, algorithm=algorithm)
            if strided:  # a view of a wider buffer: not contiguous, its neighbours must stay untouched
                wide = torch.full((*original.shape[:-1], n + 3), 7.0, dtype=dtype)
                residual = wide[..., 1:n + 1]
                residual.copy_(original)
            else:
                residual = original.clone()
            normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm_(shards[rank], b, residual, w, eps=eps, bias=bias,
                                                               algorithm=algorithm)
            what = f"{algorithm} {dtype} M={m} K={k} N={n} bias={with_bias} 3d={three_d} rank={rank}"
            if algorithm != "auto":  # auto's tuning calls may run the two ops with different algorithms
                assert torch.equal(residual, want_out), what + ": residual differs from the out-of-place out"
                assert torch.equal(normed, want_normed), what + ": normed differs from the out-of-place normed"
            assert_matches(residual, ref_sum + original.double(), dtype, k + 9, world, what + " residual")
            tol = TOLERANCE[dtype]
            torch.testing.assert_close(normed.double(), rms_norm64(residual, w, eps), rtol=tol, atol=4 * tol,
                                       msg=lambda s: f"{what} normed: {s}")
            if strided:
                assert bool((wide[..., 0] == 7).all() and (wide[..., n + 1:] == 7).all()), what + ": wrote outside"
            digests.append(digest(residual) + digest(normed))
    finally:
        _C._set_engine_option("owner_last", previous)
    return digests


@pytest.mark.parametrize("case", [(w, alg, dt) for w in (1, 2, 3, 4) for alg in ("sequential", "fused", "auto")
                                  for dt in (torch.float32, torch.bfloat16)], ids=str)
def test_in_place_is_the_out_of_place_op(ranks, case):
    world, algorithm, dtype = case
    per_rank = ranks(world).run(in_place_matches_out_of_place, random.randrange(1 << 30), algorithm, dtype)
    assert len(set(map(tuple, per_rank))) == 1, "ranks returned different tensors"


@pytest.mark.parametrize("world", [2, 3])
def test_in_place_through_the_comm_blocks(ranks, world):
    """The owner reducing in its comm block (as with comm threads) instead of the owner-last walk, and fp64."""
    for dtype in (torch.float32, torch.float64):
        ranks(world).run(in_place_matches_out_of_place, random.randrange(1 << 30), "fused", dtype, False)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("algorithm", ["sequential", "fused"])
def test_a_strided_residual_is_written_in_place(ranks, world, algorithm):
    ranks(world).run(in_place_matches_out_of_place, random.randrange(1 << 30), algorithm, torch.float32, True, True)


def overwritten_not_added(rank, world, seed):
    """The deliberate bug: the engine overwrites the residual with the sum instead of adding into it. The same
    comparison as the real test must fail."""
    with hooked("overwrite_residual", True):
        try:
            in_place_matches_out_of_place(rank, world, seed, "fused", torch.float32)
        except AssertionError:
            return "caught"
    return "missed"


def test_negative_control_residual_overwritten(hooked_ranks):
    assert hooked_ranks(2).run(overwritten_not_added, random.randrange(1 << 30)) == ["caught", "caught"]


def refused(rank, world):
    a, b = torch.randn(6, 8), torch.randn(8, 5)
    w = torch.ones(5)
    residual = torch.randn(6, 5)
    # Overlapping an input on the last rank only: every rank raises a ValueError (the peers naming that rank), and
    # the group goes on.
    shared = torch.randn(6, 8)
    last = world - 1
    bad = shared[:, :5] if rank == last else residual
    raises(lambda: torch_gemm_ar.gemm_allreduce_add_rmsnorm_(shared, b, bad, w, algorithm="fused"),
           "must not share memory with a" if rank == last else f"rank {last}", exc=ValueError)
    expanded = torch.randn(1, 5).expand(6, 5)
    raises(lambda: torch_gemm_ar.gemm_allreduce_add_rmsnorm_(a, b, expanded, w), "must not overlap", exc=ValueError)
    raises(lambda: torch_gemm_ar.gemm_allreduce_add_rmsnorm_(a, b, w.view(1, 5).expand(6, 5).clone()[:, :4], w),
           "residual must have shape", exc=ValueError)
    # No backward: refused before any rank moves data (the check is local, so every rank asks alike here).
    raises(lambda: torch_gemm_ar.gemm_allreduce_add_rmsnorm_(a.requires_grad_(), b, residual, w), "no backward",
           exc=RuntimeError)
    with torch.no_grad():
        normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm_(a, b, residual, w)
    assert normed.shape == (6, 5)


@pytest.mark.parametrize("world", [1, 2])
def test_bad_residuals_and_grad_are_refused(ranks, world):
    ranks(world).run(refused)


def compiled_in_place(rank, world, seed):
    torch._dynamo.reset()
    group = dist.group.WORLD

    def block(x, w, residual, norm_weight):
        normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm_(x, w.t(), residual, norm_weight, group, eps=1e-5)
        return torch.nn.functional.silu(normed)

    compiled = torch.compile(block, fullgraph=True)
    for step in range(3):
        shards, w, residual, nw = compile_step_inputs(seed, step, world)
        ref_out = sum(s.double() @ w.double().t() for s in shards) + residual.double()
        with torch.no_grad():
            act = compiled(shards[rank], w, residual, nw)
        torch.testing.assert_close(residual.double(), ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(act.double(), torch.nn.functional.silu(rms_norm64(ref_out, nw, 1e-5)),
                                   rtol=1e-5, atol=1e-5)


def test_torch_compile_fullgraph(ranks):
    ranks(2).run(compiled_in_place, random.randrange(1 << 30), timeout_s=300)
