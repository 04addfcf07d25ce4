"""RowParallelLinear.forward(x, residual, norm): the fused residual add + RMSNorm after the reduction, against the
full nn.Linear + add + nn.RMSNorm in float64 (forward and every gradient), world sizes 1-3, inputs of 1 to 4 dims."""
import copy
import random

import pytest
import torch
from torch import nn

from expect import raises
from test_nn_row_parallel_linear import full_linear
from torch_gemm_ar.nn import RowParallelLinear

LEAD_SHAPES = [(13,), (2, 7), (2, 3, 5), ()]


def add_norm_vs_full(rank, world, seed, dtype):
    k = 33
    in_features, out_features = k * world, 37
    for case, lead in enumerate(LEAD_SHAPES):
        bias = case % 2 == 0
        full = full_linear(seed + case, in_features, out_features, bias)
        norm_ref = nn.RMSNorm(out_features, eps=1e-5, dtype=torch.float64)
        g = torch.Generator().manual_seed(seed + 1000 + case)
        with torch.no_grad():
            norm_ref.weight.copy_(1 + 0.3 * torch.randn(out_features, generator=g, dtype=torch.float64))
        layer = RowParallelLinear.from_linear(copy.deepcopy(full).to(dtype))
        norm = copy.deepcopy(norm_ref).to(dtype)
        x_full = torch.randn(*lead, in_features, generator=g, dtype=torch.float64)
        res_full = torch.randn(*lead, out_features, generator=g, dtype=torch.float64)
        up_out, up_normed = (torch.randn(*lead, out_features, generator=g, dtype=torch.float64) for _ in range(2))
        cols = slice(rank * k, (rank + 1) * k)

        x = x_full[..., cols].to(dtype).clone().requires_grad_()
        res = res_full.to(dtype).clone().requires_grad_()
        out, normed = layer(x, res, norm)
        ((out * up_out.to(dtype)).sum() + (normed * up_normed.to(dtype)).sum()).backward()

        x_ref, res_ref = x_full.clone().requires_grad_(), res_full.clone().requires_grad_()
        out_ref = full(x_ref) + res_ref
        normed_ref = norm_ref(out_ref)
        ((out_ref * up_out).sum() + (normed_ref * up_normed).sum()).backward()
        what = f"{dtype} lead={lead} bias={bias} rank={rank}"
        tol = 1e-10 if dtype == torch.float64 else 1e-4
        pairs = [("out", out, out_ref), ("normed", normed, normed_ref), ("x.grad", x.grad, x_ref.grad[..., cols]),
                 ("residual.grad", res.grad, res_ref.grad), ("norm.weight.grad", norm.weight.grad, norm_ref.weight.grad),
                 ("weight.grad", layer.weight.grad, full.weight.grad[:, cols])]
        if bias:
            pairs.append(("bias.grad", layer.bias.grad, full.bias.grad))
        for name, got, want in pairs:
            assert got.shape == want.shape, f"{what} {name}: {got.shape} vs {want.shape}"
            scale = want.abs().max().item() + 1
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_add_norm_matches_full_layer(ranks, world, dtype):
    ranks(world).run(add_norm_vs_full, random.randrange(1 << 30), dtype)


def bad_norm(rank, world):
    layer = RowParallelLinear(4 * world, 6)
    x, res = torch.randn(3, 4), torch.randn(3, 6)
    raises(lambda: layer(x, res), "residual and norm must be given together", exc=ValueError)
    raises(lambda: layer(x, None, nn.RMSNorm(6)), "residual and norm must be given together", exc=ValueError)
    raises(lambda: layer(x, res, nn.LayerNorm(6)), "norm must be an nn.RMSNorm(6)", exc=ValueError)
    raises(lambda: layer(x, res, nn.RMSNorm(5)), "norm must be an nn.RMSNorm(6)", exc=ValueError)
    raises(lambda: layer(x, res, nn.RMSNorm(6, elementwise_affine=False)), "elementwise_affine", exc=ValueError)
    raises(lambda: layer(x, torch.randn(3, 5), nn.RMSNorm(6)), "residual must have shape", exc=ValueError)


def test_bad_norm_arguments(ranks):
    ranks(2).run(bad_norm)
