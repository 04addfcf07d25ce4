"""RowParallelLinear(sequence_parallel=True) and ColumnParallelLinear on real ranks against the full nn.Linear in
float64: forward and backward, world sizes 1-3, [tokens, H], [S, B, H] and [B, S, H] layouts."""
import copy
import random

import pytest
import torch
from torch import nn

from inputs import TOLERANCE
from torch_gemm_ar.nn import ColumnParallelLinear, RowParallelLinear

# (whole input shape without the hidden dim, as a function of world; sequence dim)
LAYOUTS = [(lambda w: (5 * w,), 0), (lambda w: (3 * w, 2), 0), (lambda w: (2, 3 * w), 1)]


def full_linear(seed, in_features, out_features, bias):
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=g, dtype=torch.float64))
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=g, dtype=torch.float64))
    return linear


def check_close(got, want, dtype, terms, what):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * (terms ** 0.5 + 1), msg=lambda m: f"{what}: {m}")


def mlp_vs_full(rank, world, seed, dtype):
    """Megatron's sequence-parallel MLP: ColumnParallelLinear -> gelu -> RowParallelLinear(sequence_parallel=True),
    input and output sharded along the sequence; against the unsharded float64 MLP."""
    hidden, inner = 13, 7 * world
    for case, (lead_of, dim) in enumerate(LAYOUTS):
        bias = case % 2 == 0
        fc1, fc2 = full_linear(seed + case, hidden, inner, bias), full_linear(seed + 50 + case, inner, hidden, True)
        col = ColumnParallelLinear.from_linear(copy.deepcopy(fc1).to(dtype), sequence_dim=dim)
        row = RowParallelLinear.from_linear(copy.deepcopy(fc2).to(dtype), sequence_parallel=True, sequence_dim=dim)
        g = torch.Generator().manual_seed(seed + 1000 + case)
        x_full = torch.randn(*lead_of(world), hidden, generator=g, dtype=torch.float64)
        upstream_full = torch.randn(*lead_of(world), hidden, generator=g, dtype=torch.float64)
        x = x_full.chunk(world, dim=dim)[rank].to(dtype).requires_grad_()
        out = row(torch.nn.functional.gelu(col(x)))
        (out * upstream_full.chunk(world, dim=dim)[rank].to(dtype)).sum().backward()

        x_ref = x_full.clone().requires_grad_()
        ref = fc2(torch.nn.functional.gelu(fc1(x_ref)))
        (ref * upstream_full).sum().backward()
        what = f"{dtype} layout={case} rank={rank}"
        check_close(out, ref.chunk(world, dim=dim)[rank], dtype, inner, what + " out")
        check_close(x.grad, x_ref.grad.chunk(world, dim=dim)[rank], dtype, inner * hidden, what + " grad x")
        rows = slice(rank * 7, (rank + 1) * 7)
        check_close(col.weight.grad, fc1.weight.grad[rows], dtype, x_full.numel(), what + " grad fc1.weight")
        check_close(row.weight.grad, fc2.weight.grad[:, rows], dtype, x_full.numel(), what + " grad fc2.weight")
        if bias:
            check_close(col.bias.grad, fc1.bias.grad[rows], dtype, x_full.numel(), what + " grad fc1.bias")
        # fc2's bias is replicated and each rank adds it to its own chunk: its gradient is this chunk's share.
        share = upstream_full.chunk(world, dim=dim)[rank].reshape(-1, hidden).sum(0)
        check_close(row.bias.grad, share, dtype, x_full.numel(), what + " grad fc2.bias")
        assert row.bias.sequence_parallel is True, "the trainer must know to all-reduce this gradient"


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_sequence_parallel_mlp_matches_full(ranks, world, dtype):
    ranks(world).run(mlp_vs_full, random.randrange(1 << 20), dtype)


def constructor_errors(rank, world):
    with pytest.raises(NotImplementedError, match="gather_output=True"):
        ColumnParallelLinear(4, 2 * world, gather_output=True)
    with pytest.raises(ValueError, match=r"\[\*, in_features=4\]"):
        ColumnParallelLinear(4, 2 * world, sequence_parallel=False)(torch.randn(3, 5))
    if world > 1:
        with pytest.raises(ValueError, match=f"out_features={2 * world + 1} is not divisible"):
            ColumnParallelLinear(4, 2 * world + 1)
    layer = ColumnParallelLinear(4, 2 * world)
    with pytest.raises(ValueError, match="in_features=4"):
        layer(torch.randn(3, 5))
    row = RowParallelLinear(2 * world, 3, sequence_parallel=True)
    with pytest.raises(ValueError, match="2-D or 3-D"):
        row(torch.randn(world, 1, 1, 2))
    assert "sequence_parallel=True" in repr(row) and "gather_output=False" in repr(layer)


@pytest.mark.parametrize("world", [1, 2])
def test_constructor_and_input_errors(ranks, world):
    ranks(world).run(constructor_errors)
