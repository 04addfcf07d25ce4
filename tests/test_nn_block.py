"""replace_row_parallel on the Llama-style decoder block of examples/tp_transformer.py, in both TP styles (DTensor
RowwiseParallel, and Megatron-style layers selected by pattern), on 2 and 3 ranks: forward and backward equal the
unfused TP model and the single-device block in float64, training steps give the same weights, and the converted
model keeps its Parameter objects, names and state_dict."""
import os
import random
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples"))

import tp_transformer as tp  # noqa: E402
import torch_gemm_ar  # noqa: E402
from torch_gemm_ar.nn import DTensorRowParallelLinear, RowParallelLinear  # noqa: E402

# hidden 60 = 6 heads of 10, ffn 90: per-rank widths 30/20 and 45/30, no tile multiple anywhere.
CONFIG = dict(hidden=60, heads=6, ffn=90)
BATCH, SEQ = 2, 7


def tensor_parallel(style: str, block, world: int):
    if style == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh

        return tp.tensor_parallel_dtensor(block, init_device_mesh("cpu", (world,)))
    return tp.tensor_parallel_plain(block, dist.group.WORLD)


def convert(style: str, model, algorithm: str):
    patterns = None if style == "dtensor" else tp.ROW_PARALLEL_PATTERNS
    return torch_gemm_ar.nn.replace_row_parallel(model, patterns=patterns, algorithm=algorithm)


def expected_local(name: str, full, rank: int, world: int) -> torch.Tensor:
    """This rank's piece of a full-model tensor (parameter or gradient) named like the TP model's parameter."""
    module_name, _, kind = name.rpartition(".")
    if module_name in tp.COLUMN_PARALLEL:
        return full.chunk(world, dim=0)[rank]
    if module_name in tp.ROW_PARALLEL and kind == "weight":
        return full.chunk(world, dim=1)[rank]
    return full


def check(got, want, tol, what):
    torch.testing.assert_close(got.detach().double(), want.detach().double(), rtol=tol, atol=tol,
                               msg=lambda m: f"{what}: {m}")


def block_equivalence(rank, world, seed, style, bias, algorithm):
    cfg = tp.BlockConfig(**CONFIG, bias=bias)
    full = tp.make_block(cfg, seed)
    full64 = tp.make_block(cfg, seed).double()
    unfused, converted = tensor_parallel(style, full, world), tensor_parallel(style, full, world)
    params_before = dict(converted.named_parameters())
    state_keys_before = list(converted.state_dict())

    replaced = convert(style, converted, algorithm)
    assert replaced == ["self_attn.o_proj", "mlp.down_proj"], replaced
    expected_type = DTensorRowParallelLinear if style == "dtensor" else RowParallelLinear
    assert all(isinstance(converted.get_submodule(n), expected_type) for n in replaced)
    # The same Parameter objects under the same names: optimizers and checkpoints are unaffected.
    params_after = dict(converted.named_parameters())
    assert params_after.keys() == params_before.keys()
    assert all(params_after[n] is params_before[n] for n in params_before)
    assert list(converted.state_dict()) == state_keys_before

    g = torch.Generator().manual_seed(seed + 1)  # replicated activations: the same on every rank
    x = torch.randn(BATCH, SEQ, cfg.hidden, generator=g)
    upstream = torch.randn(BATCH, SEQ, cfg.hidden, generator=g)
    outputs, input_grads = {}, {}
    for label, model in (("unfused", unfused), ("converted", converted)):
        xi = x.clone().requires_grad_()
        out = model(xi)
        (out * upstream).sum().backward()
        outputs[label], input_grads[label] = out, xi.grad
    x64 = x.double().requires_grad_()
    ref = full64(x64)
    (ref * upstream.double()).sum().backward()

    what = f"{style} bias={bias} {algorithm} rank {rank}"
    check(outputs["converted"], outputs["unfused"], 1e-5, what + " output vs unfused")
    check(outputs["converted"], ref, 1e-4, what + " output vs float64 block")
    check(input_grads["converted"], input_grads["unfused"], 1e-5, what + " input grad vs unfused")
    check(input_grads["converted"], x64.grad, 1e-4, what + " input grad vs float64 block")
    full_grads = {n: p.grad for n, p in full64.named_parameters()}
    unfused_params = dict(unfused.named_parameters())
    for name, p in converted.named_parameters():
        got = tp.local_tensor(p.grad)
        check(got, tp.local_tensor(unfused_params[name].grad), 1e-5, f"{what} grad {name} vs unfused")
        check(got, expected_local(name, full_grads[name], rank, world), 1e-4, f"{what} grad {name} vs float64")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("style", ["plain", "dtensor"])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_backward_match_unfused_and_float64(ranks, world, style, bias):
    algorithm = ["sequential", "chunked", "fused", "auto"][(2 * (world - 2) + bias) % 4]
    ranks(world).run(block_equivalence, random.randrange(1 << 30), style, bias, algorithm)


def training_steps(rank, world, seed, style, steps):
    cfg = tp.BlockConfig(**CONFIG, bias=True)
    full = tp.make_block(cfg, seed)
    unfused, converted = tensor_parallel(style, full, world), tensor_parallel(style, full, world)
    # SGD rather than Adam: Adam's normalisation would blow rounding-level gradient differences up to lr.
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for m in (unfused, converted)]
    # Converted after the optimizer was built: it must keep driving the same parameters.
    convert(style, converted, "fused" if style == "plain" else "chunked")
    g = torch.Generator().manual_seed(seed + 2)
    for _ in range(steps):
        x = torch.randn(BATCH, SEQ, cfg.hidden, generator=g)
        target = torch.randn(BATCH, SEQ, cfg.hidden, generator=g)
        for model, opt in zip((unfused, converted), optimizers):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), target, reduction="sum").backward()
            opt.step()
    initial = dict(full.named_parameters())
    unfused_params = dict(unfused.named_parameters())
    for name, p in converted.named_parameters():
        local = tp.local_tensor(p).detach()
        check(local, tp.local_tensor(unfused_params[name]).detach(), 1e-5, f"{style} weight {name} after {steps} steps")
        moved = (local - expected_local(name, initial[name].detach(), rank, world)).abs().max().item()
        assert moved > 1e-4, f"{name} did not train (moved {moved})"


@pytest.mark.parametrize("style", ["plain", "dtensor"])
def test_training_steps_give_the_same_weights(ranks, style):
    ranks(2).run(training_steps, random.randrange(1 << 30), style, 3)
