"""replace_sequence_parallel on DTensor plans with sequence parallelism (SequenceParallel norms,
ColwiseParallel(input_layouts=Shard(d)), RowwiseParallel(output_layouts=Shard(d))): the converted modules take and
return what the plan's hooks did, compute the float64 reference's values and gradients on each rank's shard, hold
the same Parameter objects, and what cannot be fused is refused or skipped with its reason."""
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torch_gemm_ar
from test_nn_errors import raises
from torch_gemm_ar.nn import DTensorColumnParallelLinear, DTensorRowParallelLinear

TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 6e-2}


class NormMLP(nn.Module):
    """RMSNorm -> up (column-parallel) -> GELU -> down (row-parallel): one sequence-parallel region."""

    def __init__(self, hidden, ffn, bias):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.up = nn.Linear(hidden, ffn, bias=bias)
        self.down = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _plan(seq_dim, dtensor_output):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {"norm": SequenceParallel(sequence_dim=seq_dim),
            "up": ColwiseParallel(input_layouts=Shard(seq_dim)),
            "down": RowwiseParallel(output_layouts=Shard(seq_dim), use_local_output=not dtensor_output)}


def _full_model(seed, hidden, ffn, bias, dtype):
    torch.manual_seed(seed)  # the same full weights on every rank
    model = NormMLP(hidden, ffn, bias)
    with torch.no_grad():
        model.norm.weight.normal_(1.0, 0.1)
        if bias:
            model.up.bias.normal_()
            model.down.bias.normal_()
    return model.to(dtype)


def converted_matches_reference(rank, world, seed, shape, bias, dtype_name, dtensor_output):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    dtype = getattr(torch, dtype_name)
    mesh = init_device_mesh("cpu", (world,))
    seq_dim = len(shape) - 2  # [S, H] -> 0, [B, S, H] -> 1
    hidden, ffn = shape[-1], 6 * world + 2 * world
    full = _full_model(seed, hidden, ffn, bias, dtype)
    reference = _full_model(seed, hidden, ffn, bias, dtype).double()
    unfused = parallelize_module(_full_model(seed, hidden, ffn, bias, dtype), mesh, _plan(seq_dim, dtensor_output))
    converted = parallelize_module(full, mesh, _plan(seq_dim, dtensor_output))
    up_weight, down_bias = converted.up.weight, converted.down.bias
    report = torch_gemm_ar.nn.replace_sequence_parallel(converted)
    assert sorted(report) == ["down", "up"], report
    assert report.skipped == [("norm", "SequenceParallel: a sequence-parallel module (norm or dropout) runs on its "
                                       "shard: no GEMM to fuse")], report.skipped
    assert isinstance(converted.up, DTensorColumnParallelLinear) and isinstance(converted.down, DTensorRowParallelLinear)
    assert converted.up.weight is up_weight and converted.down.bias is down_bias
    assert not converted.down.fuses_add_rmsnorm

    g = torch.Generator().manual_seed(seed + 1)  # the same full input on every rank; each takes its shard
    x_full = torch.randn(*shape, generator=g).to(dtype)
    upstream_full = torch.randn(*shape, generator=g).to(dtype)
    chunk = shape[seq_dim] // world
    x = x_full.narrow(seq_dim, rank * chunk, chunk)
    upstream = upstream_full.narrow(seq_dim, rank * chunk, chunk)

    results = []
    for model in (unfused, converted):
        xi = x.clone().requires_grad_()
        out = model(xi)
        local = out.to_local() if isinstance(out, DTensor) else out
        (local.float() * upstream.float()).sum().backward()
        results.append((out, local, xi.grad, model))
    xr = x_full.double().requires_grad_()
    out_ref = reference(xr)
    (out_ref * upstream_full.double()).sum().backward()

    (out_u, local_u, _, _), (out_c, local_c, gx_c, _) = results
    assert isinstance(out_c, DTensor) == isinstance(out_u, DTensor) == dtensor_output
    if dtensor_output:
        assert out_c.placements == out_u.placements == (Shard(seq_dim),)
    tol = TOLERANCE[dtype] * (1 + hidden / 64)

    def close(got, want, what):
        scale = want.abs().max().item() + 1.0
        err = (got.double() - want).abs().max().item()
        assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol * scale:.3g} (rank {rank}, {dtype_name})"

    close(local_c, out_ref.detach().narrow(seq_dim, rank * chunk, chunk), "output shard")
    close(gx_c, xr.grad.narrow(seq_dim, rank * chunk, chunk), "input shard gradient")
    cols = ffn // world
    close(converted.up.weight.grad.to_local(), reference.up.weight.grad[rank * cols:(rank + 1) * cols], "up.weight")
    rows = ffn // world
    close(converted.down.weight.grad.to_local(), reference.down.weight.grad[:, rank * rows:(rank + 1) * rows],
          "down.weight")
    if bias:
        close(converted.up.bias.grad.to_local(), reference.up.bias.grad[rank * cols:(rank + 1) * cols], "up.bias")
        close(converted.down.bias.grad.to_local(), reference.down.bias.grad, "down.bias")
    # Every gradient has the unfused model's placement.
    grads_u = {n: p.grad for n, p in unfused.named_parameters()}
    for name, p in converted.named_parameters():
        assert isinstance(p.grad, DTensor) and p.grad.placements == grads_u[name].placements, name


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shape,bias,dtype,dtensor_output", [
    ((2, 7, 20), True, "float32", False),    # [B, S, H], the sequence on dim 1; odd shard length
    ((2, 7, 20), False, "bfloat16", True),   # a Shard(1) DTensor output
    ((11, 13), True, "float32", True),       # [tokens, H], the sequence on dim 0
])
def test_converted_matches_float64(ranks, world, shape, bias, dtype, dtensor_output):
    shape = (*shape[:-2], shape[-2] * world, shape[-1])  # the sequence splits into equal shards
    ranks(world).run(converted_matches_reference, random.randrange(1 << 30), shape, bias, dtype, dtensor_output)


def refused_and_skipped(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    convert = torch_gemm_ar.nn.replace_sequence_parallel

    def model_with(plan, hidden=8, ffn=4 * world):
        return parallelize_module(NormMLP(hidden, ffn, True), mesh, plan)

    # A gathered column-parallel output would be a second all-gather.
    model = model_with({"up": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    raises(lambda: convert(model), "'up'", "output_layouts", exc=ValueError)
    assert not isinstance(model.up, DTensorColumnParallelLinear), "a failed call must leave the model untouched"
    # A hook of the user's would be lost.
    model = model_with({"down": RowwiseParallel(output_layouts=Shard(1))})
    model.down.register_forward_hook(lambda mod, inputs, output: output)
    raises(lambda: convert(model), "'down'", "other hooks", exc=ValueError)
    # Uneven column shards.
    model = model_with({"up": ColwiseParallel(input_layouts=Shard(1))}, ffn=2 * world + 1)
    raises(lambda: convert(model), "out_features=", "not divisible", exc=ValueError)
    # A plan without sequence parallelism: nothing to convert here, replace_row_parallel's job.
    model = model_with({"up": ColwiseParallel(), "down": RowwiseParallel()})
    raises(lambda: convert(model), "found no nn.Linear", exc=ValueError)
    # Mixed: the all_reduce layer is skipped with a pointer to replace_row_parallel, the sequence-parallel one taken.
    model = model_with({"up": ColwiseParallel(input_layouts=Shard(1)), "down": RowwiseParallel()})
    report = convert(model)
    assert report == ["up"], report
    assert report.skipped and report.skipped[0][0] == "down" and "replace_row_parallel" in report.skipped[0][1]
    assert "replace_sequence_parallel: replaced 1 module(s)" in str(report)
    assert convert(model) == [], "already converted: nothing left to do"
    # replace_row_parallel refuses the reduce-scatter form and names the sibling.
    model = model_with({"down": RowwiseParallel(output_layouts=Shard(1))})
    raises(lambda: torch_gemm_ar.nn.replace_row_parallel(model), "reduce-scatter", "replace_sequence_parallel",
           exc=ValueError)
    # The reduce-scatter form has no whole rows to normalise.
    convert(model, patterns=["down"])
    raises(lambda: model.down(torch.randn(2, 4, 8), torch.zeros(2, 4, 8), nn.RMSNorm(8)), "whole output rows",
           exc=ValueError)
    raises(lambda: convert(model, patterns=[""]), "patterns", exc=ValueError)
    dist.barrier()


def test_refuses_and_skips_with_reasons(ranks):
    ranks(2).run(refused_and_skipped)
