"""Autograd of the op (row-parallel linear: no communication in backward) and torch.compile(fullgraph=True)."""
import random

import pytest
import torch
import torch.distributed as dist

import torch_gemm_ar
from inputs import bias_vector, shard, weight
from rank0_gradcheck import gradcheck_on_rank0


def gradcheck_rank0_inputs(rank, world, seed, algorithm):
    """gradcheck of rank 0's a, b and bias while the other ranks keep contributing fixed shards."""
    a = shard(seed, rank, 5, 4, torch.float64)
    b = weight(seed + rank, 4, 3, torch.float64, transposed=True)
    bias = bias_vector(seed, 3, torch.float64)

    def op(a_, b_, bias_):
        return torch_gemm_ar.gemm_allreduce(a_, b_, bias=bias_, algorithm=algorithm)

    return gradcheck_on_rank0(rank, op, (a, b, bias), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("algorithm", ["sequential", "chunked"])
def test_gradcheck_float64(ranks, world, algorithm):
    assert all(ranks(world).run(gradcheck_rank0_inputs, random.randrange(1 << 30), algorithm))


def grads_vs_unfused(rank, world, seed, dtype, three_d):
    m, k, n = 12, 9, 7
    shards = [shard(seed, r, m, k, dtype, three_d) for r in range(world)]
    weights = [weight(seed + r, k, n, dtype, transposed=True) for r in range(world)]
    bias = bias_vector(seed, n, dtype)
    upstream = torch.randn(*shards[0].shape[:-1], n, generator=torch.Generator().manual_seed(seed), dtype=dtype)

    a, b, c = (t.detach().clone().requires_grad_() for t in (shards[rank], weights[rank], bias))
    (torch_gemm_ar.gemm_allreduce(a, b, bias=c) * upstream).sum().backward()

    # Unfused float64 reference: this rank's product is differentiable, the others' are constants.
    a_ref, b_ref, c_ref = (t.detach().double().requires_grad_() for t in (shards[rank], weights[rank], bias))
    others = sum(shards[r].double() @ weights[r].double() for r in range(world) if r != rank)
    ((a_ref @ b_ref + others + c_ref) * upstream.double()).sum().backward()
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for name, got, want in [("a", a.grad, a_ref.grad), ("b", b.grad, b_ref.grad), ("bias", c.grad, c_ref.grad)]:
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol, msg=lambda s: f"grad {name}: {s}")
    # b's gradient comes in b's own layout (here a transposed weight view, as nn.Linear's weight.t()), so
    # AccumulateGrad takes it without copying it into the parameter's layout.
    (grad_b,) = torch.autograd.grad((torch_gemm_ar.gemm_allreduce(a, b, bias=c) * upstream).sum(), (b,))
    assert grad_b.stride() == b.stride(), (grad_b.stride(), b.stride())


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("three_d", [False, True])
def test_gradients_match_unfused(ranks, world, dtype, three_d):
    ranks(world).run(grads_vs_unfused, random.randrange(1 << 30), dtype, three_d)


def compiled_call(rank, world, seed):
    torch._dynamo.reset()
    group = dist.group.WORLD

    def layer(x, w, bias):
        return torch.nn.functional.gelu(torch_gemm_ar.gemm_allreduce(x, w.t(), group, bias=bias)) * 2

    compiled = torch.compile(layer, fullgraph=True)
    for step in range(3):
        shards = [shard(seed + step, r, 16 + step, 8, torch.float32) for r in range(world)]
        w = weight(seed + step, 8, 6, torch.float32, transposed=False).t().contiguous()  # [N, K] like nn.Linear
        bias = bias_vector(seed, 6, torch.float32)
        x = shards[rank].clone().requires_grad_()
        out = compiled(x, w, bias)
        ref_in = sum(s @ w.t() for s in shards) + bias
        torch.testing.assert_close(out, torch.nn.functional.gelu(ref_in) * 2, rtol=2e-5, atol=2e-5)
        out.sum().backward()
        x_ref = shards[rank].clone().requires_grad_()
        others = sum(s @ w.t() for r, s in enumerate(shards) if r != rank)
        (torch.nn.functional.gelu(x_ref @ w.t() + others + bias) * 2).sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=2e-5, atol=2e-5)


def test_torch_compile_fullgraph(ranks):
    ranks(2).run(compiled_call, random.randrange(1 << 30), timeout_s=300)
