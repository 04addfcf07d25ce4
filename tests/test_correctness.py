"""gemm_allreduce vs a float64 reference on real rank processes: every algorithm, world sizes 1-4, odd shapes,
every CPU dtype, bias, transposed weights, 3-D inputs; and every rank returns bitwise the same tensor."""
import random

import pytest
import torch

import torch_gemm_ar
from inputs import ODD_SHAPES, assert_matches, assert_matches_sum_of_partials, bias_vector, digest, reference, shard, weight

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def check_shapes(rank, world, seed, algorithm, dtype):
    digests = []
    for case, (m, k, n) in enumerate(ODD_SHAPES):
        with_bias, transposed, three_d = case % 2 == 0, case % 3 != 1, case % 4 == 3
        shards = [shard(seed + case, r, m, k, dtype, three_d) for r in range(world)]
        b = weight(seed + case, k, n, dtype, transposed)
        bias = bias_vector(seed + case, n, dtype) if with_bias else None
        out = torch_gemm_ar.gemm_allreduce(shards[rank], b, bias=bias, algorithm=algorithm)
        what = (f"{algorithm} {dtype} M={m} K={k} N={n} bias={with_bias} bT={transposed} 3d={three_d} rank={rank} "
                f"seed={seed + case}")
        if algorithm == "fused":  # the engine reduces in fp32
            assert_matches(out, reference(shards, b, bias), dtype, k, world, what)
        else:  # 2-byte partials go to torch's all_reduce, which adds them in their dtype
            assert_matches_sum_of_partials(out, shards, b, bias, dtype, k, what, reduced_in_dtype=True)
        digests.append(digest(out))
    return digests


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("algorithm", ["sequential", "chunked", "fused", "auto"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_reference(ranks, world, algorithm, dtype):
    digests = ranks(world).run(check_shapes, random.randrange(1 << 30), algorithm, dtype)
    assert all(d == digests[0] for d in digests), "ranks returned different tensors"


def empty_and_k0(rank, world, algorithm):
    a = torch.randn(0, 5)
    b = torch.randn(5, 3)
    out = torch_gemm_ar.gemm_allreduce(a, b, algorithm=algorithm)
    assert out.shape == (0, 3)
    a3 = torch.randn(2, 0, 5)
    assert torch_gemm_ar.gemm_allreduce(a3, b, algorithm=algorithm).shape == (2, 0, 3)
    # K = 0: the product is all zeros, plus the bias once.
    bias = torch.full((3,), 1.5)
    out = torch_gemm_ar.gemm_allreduce(torch.randn(4, 0), torch.randn(0, 3), bias=bias, algorithm=algorithm)
    torch.testing.assert_close(out, bias.expand(4, 3))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("algorithm", ["sequential", "chunked", "fused", "auto"])
def test_empty_m_and_zero_k(ranks, world, algorithm):
    ranks(world).run(empty_and_k0, algorithm)


def via_torch_ops(rank, world, seed):
    a = shard(seed, rank, 37, 19, torch.float32)
    b = weight(seed, 19, 23, torch.float32, transposed=True)
    group_name = torch.distributed.group.WORLD.group_name
    out = torch.ops.pto.gemm_allreduce(a, b, group_name, algorithm="sequential")
    ref = reference([shard(seed, r, 37, 19, torch.float32) for r in range(world)], b)
    assert_matches(out, ref, torch.float32, 19, world, "torch.ops.pto.gemm_allreduce")


def test_torch_ops_entry_point(ranks):
    ranks(2).run(via_torch_ops, random.randrange(1 << 30))


def subgroup_and_back_to_back(rank, world, seed):
    import torch.distributed as dist

    sub = dist.new_group([0, 1])
    for step in range(20):
        m, k, n = 50 + step, 30 + step % 7, 40 + 3 * step
        shards = [shard(seed + step, r, m, k, torch.float32) for r in range(world)]
        b = weight(seed + step, k, n, torch.float32, transposed=step % 2 == 0)
        algorithm = ["sequential", "chunked"][step % 2]
        out = torch_gemm_ar.gemm_allreduce(shards[rank], b, algorithm=algorithm)
        assert_matches(out, reference(shards, b), torch.float32, k, world, f"world step {step}")
        if rank in (0, 1):
            out = torch_gemm_ar.gemm_allreduce(shards[rank], b, sub, algorithm=algorithm)
            assert_matches(out, reference(shards[:2], b), torch.float32, k, 2, f"subgroup step {step}")
    dist.destroy_process_group(sub)


def test_subgroup_and_back_to_back_calls(ranks):
    ranks(3).run(subgroup_and_back_to_back, random.randrange(1 << 30))
