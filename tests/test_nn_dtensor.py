"""replace_row_parallel on modules parallelized with torch.distributed.tensor.parallel.RowwiseParallel: the
converted module takes and returns what RowwiseParallel's hooks took and returned (input_layouts, DTensor inputs,
use_local_output), gradients reach the same DTensor parameters, and what cannot be fused is refused clearly."""
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torch_gemm_ar
from test_nn_errors import raises
from torch_gemm_ar.nn import DTensorRowParallelLinear


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _two_layer_model(seed, in_features, hidden, out_features):
    torch.manual_seed(seed)  # the same full weights on every rank
    model = nn.Sequential(nn.Linear(in_features, hidden), nn.Linear(hidden, out_features))
    with torch.no_grad():
        model[1].bias.normal_()
    return model


def layouts_round_trip(rank, world, seed, case):
    """Same model parallelized twice; the second is converted; both must agree in values, types and placements."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = _mesh(world)
    in_features, hidden, out_features = 11, 9 * world, 13
    if case == "dtensor-input":  # the upstream layer hands over a Shard(-1) DTensor
        plan = {"0": ColwiseParallel(use_local_output=False), "1": RowwiseParallel()}
    elif case == "replicated-input":  # the row-parallel layer gets the full activation and slices it
        plan = {"1": RowwiseParallel(input_layouts=Replicate())}
    elif case == "dtensor-output":  # the rest of the model wants a Replicate DTensor back
        plan = {"0": ColwiseParallel(), "1": RowwiseParallel(use_local_output=False)}
    models = []
    for _ in range(2):
        models.append(parallelize_module(_two_layer_model(seed, in_features, hidden, out_features), mesh, plan))
    unfused, converted = models
    weight, bias = converted[1].weight, converted[1].bias
    report = torch_gemm_ar.nn.replace_row_parallel(converted, algorithm="chunked")
    assert report == ["1"]
    if "0" in plan:  # the column-parallel layer is reported as left alone, with its reason
        assert report.skipped == [("0", "ColwiseParallel: column-parallel: its GEMM is followed by no reduction (its "
                                   "backward all-reduce of the input gradient: replace_column_parallel fuses it)")]
    else:
        assert report.skipped == [], report.skipped
    assert isinstance(converted[1], DTensorRowParallelLinear)
    assert converted[1].weight is weight and converted[1].bias is bias

    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(3, 5, in_features, generator=g)
    upstream = torch.randn(3, 5, out_features, generator=g)
    results = []
    for model in (unfused, converted):
        xi = x.clone().requires_grad_()
        out = model(xi)
        local = out.to_local() if isinstance(out, DTensor) else out
        (local * upstream).sum().backward()
        results.append((out, xi.grad, {n: p.grad for n, p in model.named_parameters()}))
    (out_u, gx_u, grads_u), (out_c, gx_c, grads_c) = results
    # (the unfused local output may be an AsyncCollectiveTensor, a torch.Tensor subclass that waits on use)
    assert isinstance(out_c, DTensor) == isinstance(out_u, DTensor), (type(out_c), type(out_u))
    if isinstance(out_u, DTensor):
        assert out_c.placements == out_u.placements == (Replicate(),)
        out_u, out_c = out_u.to_local(), out_c.to_local()
    torch.testing.assert_close(out_c, out_u, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx_c, gx_u, rtol=1e-5, atol=1e-5)
    for name, grad in grads_u.items():
        if isinstance(grad, DTensor):
            assert isinstance(grads_c[name], DTensor) and grads_c[name].placements == grad.placements, name
            grad, grads_c[name] = grad.to_local(), grads_c[name].to_local()
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"grad {name}: {m}")
    assert converted[1].weight.grad.placements == (Shard(1),)


@pytest.mark.parametrize("case", ["dtensor-input", "replicated-input", "dtensor-output"])
@pytest.mark.parametrize("world", [2, 3])
def test_inputs_and_outputs_stay_as_the_model_expects(ranks, world, case):
    ranks(world).run(layouts_round_trip, random.randrange(1 << 30), case)


def refused(rank, world):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = _mesh(world)
    convert = torch_gemm_ar.nn.replace_row_parallel

    def model_with(plan, in_features=8, hidden=6, out_features=5):
        model = nn.Sequential(nn.Linear(in_features, hidden), nn.Linear(hidden, out_features))
        return parallelize_module(model, mesh, plan)

    # A column-parallel layer is not row-parallel.
    model = model_with({"0": ColwiseParallel(), "1": RowwiseParallel()})
    raises(lambda: convert(model, patterns=["0"]), "'0'", "not sharded along the input dimension", exc=ValueError)
    assert not isinstance(model[1], DTensorRowParallelLinear), "a failed call must leave the model untouched"
    # Sequence parallelism: the GEMM is followed by a reduce-scatter, not by an all_reduce.
    model = model_with({"1": RowwiseParallel(output_layouts=Shard(1))})
    raises(lambda: convert(model), "output_layouts", "reduce-scatter", exc=ValueError)
    # Uneven shards: K would differ between ranks.
    model = model_with({"1": RowwiseParallel()}, hidden=2 * world + 1)
    raises(lambda: convert(model), "in_features=", "not divisible", exc=ValueError)
    # A group that is not the mesh's.
    other = dist.new_group(list(range(world)))
    model = model_with({"1": RowwiseParallel()})
    raises(lambda: convert(model, group=other), "wrong group", exc=ValueError)
    assert convert(model, group=mesh.get_group()) == ["1"]
    assert convert(model) == [], "already converted: nothing left to do"
    # RowwiseParallel on an Embedding is a lookup, not a GEMM.
    emb = parallelize_module(nn.Sequential(nn.Embedding(4 * world, 3)), mesh,
                             {"0": RowwiseParallel(input_layouts=Replicate())})
    raises(lambda: convert(emb), "Embedding", "not an nn.Linear", exc=ValueError)
    # A hook of the user's would be lost.
    model = model_with({"1": RowwiseParallel()})
    model[1].register_forward_hook(lambda mod, inputs, output: output)
    raises(lambda: convert(model), "other hooks", exc=ValueError)
    # A model without DTensor row-parallel layers and no patterns.
    raises(lambda: convert(nn.Sequential(nn.Linear(4, 4))), "no module parallelized with RowwiseParallel",
           "patterns=", exc=ValueError)
    dist.destroy_process_group(other)


def test_refuses_what_it_cannot_fuse(ranks):
    ranks(2).run(refused)
