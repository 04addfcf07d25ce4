"""gemm_reduce_scatter and allgather_gemm (sequence parallelism): results, gradients and torch.compile against float64
references on fresh random inputs, world sizes 1-4, odd shapes, bias, 2-D and 3-D inputs sharded along each row dim.
Every rank rebuilds every rank's inputs from the seed and checks its own output."""
import random

import pytest
import torch
import torch.distributed as dist

import torch_gemm_ar
from inputs import TOLERANCE, assert_matches

DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def randn(seed, *shape, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


# (a's shape per rank for world W, shard dim): 2-D and 3-D, sharded along dim 0 and dim 1 (also as -2); sizes odd
# (not multiples of any tile) and a whole size along the sharded dim that is divisible by W.
def layouts(world):
    return [
        (lambda k: (world * 1, k), 0),
        (lambda k: (world * 7, k), 0),
        (lambda k: (world * 65, k), -2),
        (lambda k: (world * 2, 5, k), 0),
        (lambda k: (3, world * 3, k), 1),
        (lambda k: (1, world * 5, k), -2),
    ]


SIZES = [(1, 1), (33, 65), (300, 7), (17, 777)]  # (K, N)


def reduce_scatter_results(rank, world, seed, dtype):
    checked = 0
    for li, (shape_of, dim) in enumerate(layouts(world)):
        for ki, (k, n) in enumerate(SIZES):
            for with_bias in (False, True):
                s = seed + 1000 * li + 10 * ki + with_bias
                shards = [randn(s * 31 + r, *shape_of(k), dtype=dtype) for r in range(world)]
                weights = [randn(s * 37 + r, k, n, dtype=dtype) for r in range(world)]
                bias = randn(s * 41, n, dtype=dtype) if with_bias else None
                out = torch_gemm_ar.gemm_reduce_scatter(
                    shards[rank], weights[rank], scatter_dim=dim, bias=bias, algorithm="sequential"
                )
                full = sum(a.double() @ w.double() for a, w in zip(shards, weights))
                if bias is not None:
                    full = full + bias.double()
                want = full.chunk(world, dim=dim)[rank]
                assert_matches(out, want, dtype, k, world, f"rs layout {li} k={k} n={n} bias={with_bias}")
                # auto (sequential or the fused engine, as measured) gives the same answer.
                again = torch_gemm_ar.gemm_reduce_scatter(shards[rank], weights[rank], scatter_dim=dim, bias=bias)
                assert_matches(again, want, dtype, k, world, f"rs auto layout {li} k={k} n={n} bias={with_bias}")
                checked += 1
    return checked


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemm_reduce_scatter_matches_float64(ranks, world, dtype):
    counts = ranks(world).run(reduce_scatter_results, random.randrange(1 << 20), dtype, timeout_s=300)
    assert all(c == 48 for c in counts), counts


def allgather_results(rank, world, seed, dtype):
    checked = 0
    for li, (shape_of, dim) in enumerate(layouts(world)):
        for ki, (k, n) in enumerate(SIZES):
            for with_bias in (False, True):
                s = seed + 1000 * li + 10 * ki + with_bias
                shard_shape = list(shape_of(k))
                shard_shape[dim] //= world  # these layouts give whole sizes; allgather_gemm takes the shard
                shards = [randn(s * 31 + r, *shard_shape, dtype=dtype) for r in range(world)]
                w = randn(s * 37 + rank, k, n, dtype=dtype)  # this rank's column shard of the weight
                bias = randn(s * 41 + rank, n, dtype=dtype) if with_bias else None
                out, gathered = torch_gemm_ar.allgather_gemm(
                    shards[rank], w, gather_dim=dim, bias=bias, return_gathered=True, algorithm="sequential"
                )
                assert torch.equal(gathered, torch.cat(shards, dim=dim)), "gathered a is not the concatenation"
                want = torch.cat(shards, dim=dim).double() @ w.double()
                if bias is not None:
                    want = want + bias.double()
                assert_matches(out, want, dtype, k, 1, f"ag layout {li} k={k} n={n} bias={with_bias}")
                only = torch_gemm_ar.allgather_gemm(shards[rank], w, gather_dim=dim, bias=bias)
                assert_matches(only, want, dtype, k, 1, f"ag auto layout {li} k={k} n={n} bias={with_bias}")
                checked += 1
    return checked


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allgather_gemm_matches_float64(ranks, world, dtype):
    counts = ranks(world).run(allgather_results, random.randrange(1 << 20), dtype, timeout_s=300)
    assert all(c == 48 for c in counts), counts


def reduce_scatter_grads(rank, world, seed, dtype, shard_shape, dim, algorithm="auto"):
    """Every rank's loss is (its output chunk * its upstream).sum(); the gradients are of the sum of those losses."""
    k, n = shard_shape[-1], 11
    shards = [randn(seed * 31 + r, *shard_shape) for r in range(world)]
    weights = [randn(seed * 37 + r, k, n) for r in range(world)]
    biases = [randn(seed * 41, n) for r in range(world)]  # replicated values, one parameter per rank
    chunk_shape = list(shard_shape[:-1]) + [n]
    chunk_shape[dim] //= world
    upstream = [randn(seed * 43 + r, *chunk_shape) for r in range(world)]

    a, b, c = (t[rank].to(dtype).clone().requires_grad_() for t in (shards, weights, biases))
    out = torch_gemm_ar.gemm_reduce_scatter(a, b, scatter_dim=dim, bias=c, algorithm=algorithm)
    (out * upstream[rank].to(dtype)).sum().backward()

    ref = [[t.detach().clone().requires_grad_() for t in ts] for ts in (shards, weights, biases)]
    full = sum(x @ w for x, w in zip(ref[0], ref[1]))
    chunks = full.chunk(world, dim=dim)
    sum((chunks[r] + ref[2][r]) * upstream[r] for r in range(world)).sum().backward()
    tol = TOLERANCE[dtype] * 10
    for name, got, want in [("a", a.grad, ref[0][rank].grad), ("b", b.grad, ref[1][rank].grad),
                            ("bias", c.grad, ref[2][rank].grad)]:
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * (k * world) ** 0.5,
                                   msg=lambda m: f"grad {name}: {m}")


def allgather_grads(rank, world, seed, dtype, shard_shape, dim, algorithm="auto"):
    k, n = shard_shape[-1], 11
    shards = [randn(seed * 31 + r, *shard_shape) for r in range(world)]
    weights = [randn(seed * 37 + r, k, n) for r in range(world)]
    biases = [randn(seed * 41 + r, n) for r in range(world)]
    out_shape = list(shard_shape[:-1]) + [n]
    out_shape[dim] *= world
    upstream = [randn(seed * 43 + r, *out_shape) for r in range(world)]

    a, b, c = (t[rank].to(dtype).clone().requires_grad_() for t in (shards, weights, biases))
    out = torch_gemm_ar.allgather_gemm(a, b, gather_dim=dim, bias=c, algorithm=algorithm)
    (out * upstream[rank].to(dtype)).sum().backward()

    ref = [[t.detach().clone().requires_grad_() for t in ts] for ts in (shards, weights, biases)]
    gathered = torch.cat(ref[0], dim=dim)
    sum((gathered @ ref[1][r] + ref[2][r]) * upstream[r] for r in range(world)).sum().backward()
    tol = TOLERANCE[dtype] * 10
    for name, got, want in [("a", a.grad, ref[0][rank].grad), ("b", b.grad, ref[1][rank].grad),
                            ("bias", c.grad, ref[2][rank].grad)]:
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * (n * world) ** 0.5,
                                   msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("shape,dim", [((7, 13), 0), ((2, 5, 9), 0), ((3, 5, 9), 1)], ids=["2d", "3d-dim0", "3d-dim1"])
def test_gradients_match_float64(ranks, world, dtype, shape, dim):
    seed = random.randrange(1 << 20)
    # gemm_reduce_scatter's input holds the whole sequence: its scatter dim is `world` times the shard's.
    whole = list(shape)
    whole[dim] *= world
    ranks(world).run(reduce_scatter_grads, seed, dtype, tuple(whole), dim)
    ranks(world).run(allgather_grads, seed, dtype, shape, dim)


def compiled_sequence_parallel_block(rank, world, seed):
    """Megatron's sequence-parallel MLP: AG+GEMM (column-parallel) -> gelu -> GEMM+RS (row-parallel)."""
    torch._dynamo.reset()
    group = dist.group.WORLD

    def block(x, w1, w2, bias):
        h = torch_gemm_ar.allgather_gemm(x, w1.t(), group, gather_dim=1)
        return torch_gemm_ar.gemm_reduce_scatter(torch.nn.functional.gelu(h), w2.t(), group, scatter_dim=1, bias=bias)

    compiled = torch.compile(block, fullgraph=True)
    for step in range(2):
        s = seed + step
        xs = [randn(s * 31 + r, 2, 3 + step, 8, dtype=torch.float32) for r in range(world)]
        w1s = [randn(s * 37 + r, 5, 8, dtype=torch.float32) for r in range(world)]  # [hidden/world, model]
        w2s = [randn(s * 39 + r, 8, 5, dtype=torch.float32) for r in range(world)]  # [model, hidden/world]
        bias = randn(s * 41, 8, dtype=torch.float32)
        x = xs[rank].clone().requires_grad_()
        out = compiled(x, w1s[rank], w2s[rank], bias)
        seq = torch.cat(xs, dim=1)
        want = sum(torch.nn.functional.gelu(seq @ w1.t()) @ w2.t() for w1, w2 in zip(w1s, w2s)) + bias
        torch.testing.assert_close(out, want.chunk(world, dim=1)[rank], rtol=3e-5, atol=3e-5)
        out.sum().backward()
        ref = [t.clone().requires_grad_() for t in xs]
        seq = torch.cat(ref, dim=1)
        (sum(torch.nn.functional.gelu(seq @ w1.t()) @ w2.t() for w1, w2 in zip(w1s, w2s)) + bias).sum().backward()
        torch.testing.assert_close(x.grad, ref[rank].grad, rtol=3e-5, atol=3e-5)


def test_torch_compile_fullgraph(ranks):
    ranks(2).run(compiled_sequence_parallel_block, random.randrange(1 << 20), timeout_s=300)


def test_registered_schemas():
    assert "int scatter_dim=0" in str(torch.ops.pto.gemm_reduce_scatter.default._schema)
    assert "-> (Tensor, Tensor?)" in str(torch.ops.pto.allgather_gemm.default._schema)
