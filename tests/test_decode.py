"""Decode calls of the CPU engine (M <= 64 on one-core ranks: cpu/call_plan.h, CallPlan::decode): each rank's partial
is torch's own `a @ b` (one GEMM call, no tiles), every rank sums every partial in rank order in fp32 and rounds once.
Checked against float64 and bit for bit against that sum of torch's products, with fresh random inputs, odd N, bias,
fp32 and bf16, world 2 and 3, for gemm_allreduce and both add+RMSNorm ops; every rank returns the same bits; the path
is really taken."""
import random

import pytest
import torch

import torch_gemm_ar
from inputs import assert_matches, assert_matches_sum_of_partials, bias_vector, digest, reference, shard, weight
from scoped_env import engine_switch, scoped_env
from engine_observation_build import observe

INLINE = dict(TORCH_GEMM_AR_COMM_THREADS="0", TORCH_GEMM_AR_COMPUTE_THREADS="1")
# (M, K, N): decode sizes, N odd or not a multiple of anything.
SHAPES = [(1, 300, 257), (4, 64, 1001), (16, 129, 515), (64, 70, 33), (3, 1, 9)]
EPS = 1e-6


def torch_sum_of_products(shards, b, dtype):
    """What decode must return without a bias, bit for bit: torch's a_r @ b per rank, summed in rank order in fp32
    (fp64 for fp64), rounded once to the dtype."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    total = None
    for a in shards:
        part = (a @ b).to(acc)
        total = part if total is None else total + part
    return total.to(dtype)


def decode_calls(rank, world, seed):
    results = []
    with scoped_env(**INLINE):
        for i, (m, k, n) in enumerate(SHAPES):
            for dtype in (torch.float32, torch.bfloat16):
                step = seed + 101 * i + (dtype == torch.bfloat16)
                shards = [shard(step, r, m, k, dtype) for r in range(world)]
                b = weight(step, k, n, dtype, transposed=i % 2 == 0)
                what = f"M={m} K={k} N={n} {dtype} world {world}"
                before = observe.decode_calls()
                plain = torch_gemm_ar.gemm_allreduce(shards[rank], b, algorithm="fused")
                assert torch.equal(plain, torch_sum_of_products(shards, b, dtype)), (
                    f"{what}: not the rank-order sum of torch's a @ b")
                bias = bias_vector(step, n, dtype)
                with_bias = torch_gemm_ar.gemm_allreduce(shards[rank], b, bias=bias, algorithm="fused")
                assert_matches_sum_of_partials(with_bias, shards, b, bias, dtype, k, what + " bias")
                # add+RMSNorm: the sum, the residual added, then RMSNorm of the rounded sum; the in-place op alike.
                residual = shard(step, world + 1, m, n, dtype)  # the same on every rank
                norm_weight = bias_vector(step + 1, n, dtype)
                out, normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm(shards[rank], b, residual, norm_weight,
                                                                       eps=EPS, bias=bias, algorithm="fused")
                in_place = residual.clone()
                with torch.no_grad():
                    normed_ = torch_gemm_ar.gemm_allreduce_add_rmsnorm_(shards[rank], b, in_place, norm_weight,
                                                                        eps=EPS, bias=bias, algorithm="fused")
                taken = observe.decode_calls() - before
                assert_matches(out, reference(shards, b, bias) + residual.double(), dtype, k, world, what + " out")
                assert torch.equal(in_place, out) and torch.equal(normed_, normed), f"{what}: in place differs"
                got = out.double()
                want = got * torch.rsqrt(got.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight.double()
                tol = 3e-5 if dtype == torch.float32 else 1e-2
                torch.testing.assert_close(normed.double(), want, rtol=tol, atol=tol,
                                           msg=lambda msg: f"{what} normed: {msg}")
                results.append((what, taken, digest(plain), digest(with_bias), digest(out), digest(normed)))
        # Control: with the decode option off the same call takes another geometry, and is not counted.
        before = observe.decode_calls()
        with engine_switch("decode", False):
            torch_gemm_ar.gemm_allreduce(shard(seed, rank, 4, 64, torch.float32),
                                         weight(seed, 64, 1001, torch.float32, transposed=False), algorithm="fused")
        results.append(("decode off", observe.decode_calls() - before, "", "", "", ""))
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_decode_matches_torch_products_and_float64(ranks, world):
    per_rank = ranks(world).run(decode_calls, random.randrange(1 << 20), timeout_s=300)
    assert all(r == per_rank[0] for r in per_rank), "ranks returned different bits"  # digests included
    for what, taken, *_ in per_rank[0]:
        assert taken == (0 if what == "decode off" else 4), f"{what}: {taken} decode calls of 4"
