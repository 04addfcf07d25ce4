"""replace_row_parallel and replace_column_parallel on the Llama-style decoder block of examples/tp_transformer.py,
in its TP styles (DTensor RowwiseParallel / ColwiseParallel, Megatron-style layers selected by pattern, and --
replace_sequence_parallel -- DTensor with sequence parallelism, where each rank holds a chunk of the sequence), on 2
and 3 ranks: forward and backward equal the unfused TP model and the single-device block in float64, training steps
give the same weights, and the converted model keeps its Parameter objects, names and state_dict."""
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
from torch_gemm_ar.nn import (  # noqa: E402
    ColumnParallelLinear, DTensorColumnParallelLinear, DTensorRowParallelLinear, RowParallelLinear,
)

# hidden 60 = 6 heads of 10, ffn 90: per-rank widths 30/20 and 45/30, no tile multiple anywhere.
CONFIG = dict(hidden=60, heads=6, ffn=90)
BATCH, SEQ = 2, 7


def tensor_parallel(style: str, block, world: int):
    if style in ("dtensor", "sp"):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        make = tp.tensor_parallel_dtensor if style == "dtensor" else tp.tensor_parallel_sequence
        return make(block, mesh)
    return tp.tensor_parallel_plain(block, dist.group.WORLD)


def convert(style: str, model, algorithm: str):
    if style == "sp":
        return torch_gemm_ar.nn.replace_sequence_parallel(model, algorithm=algorithm)
    patterns = None if style == "dtensor" else tp.ROW_PARALLEL_PATTERNS
    replaced = torch_gemm_ar.nn.replace_row_parallel(model, patterns=patterns, algorithm=algorithm)
    # The column-parallel layers too: their backward all-reduce of the input gradient becomes a gemm_allreduce.
    patterns = None if style == "dtensor" else tp.COLUMN_PARALLEL_PATTERNS
    return replaced + torch_gemm_ar.nn.replace_column_parallel(model, patterns=patterns, algorithm=algorithm)


def seq_len(style: str, world: int) -> int:
    return SEQ * world if style == "sp" else SEQ  # sequence parallelism: an odd chunk of SEQ rows per rank


def local_rows(style: str, t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """What this rank holds of a [B, S, H] activation: its chunk of the sequence under sequence parallelism."""
    return t.chunk(world, dim=1)[rank] if style == "sp" else t


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
    assert sorted(replaced) == sorted(tp.ROW_PARALLEL + tp.COLUMN_PARALLEL), replaced
    expected_type = {"dtensor": DTensorRowParallelLinear, "plain": RowParallelLinear, "sp": DTensorRowParallelLinear}
    assert all(isinstance(converted.get_submodule(n), expected_type[style]) for n in tp.ROW_PARALLEL)
    column_type = ColumnParallelLinear if style == "plain" else DTensorColumnParallelLinear
    assert all(isinstance(converted.get_submodule(n), column_type) for n in tp.COLUMN_PARALLEL)
    # The same Parameter objects under the same names: optimizers and checkpoints are unaffected.
    params_after = dict(converted.named_parameters())
    assert params_after.keys() == params_before.keys()
    assert all(params_after[n] is params_before[n] for n in params_before)
    assert list(converted.state_dict()) == state_keys_before

    g = torch.Generator().manual_seed(seed + 1)  # the same full activations on every rank
    x = torch.randn(BATCH, seq_len(style, world), cfg.hidden, generator=g)
    upstream = torch.randn(BATCH, seq_len(style, world), cfg.hidden, generator=g)
    outputs, input_grads = {}, {}
    for label, model in (("unfused", unfused), ("converted", converted)):
        xi = local_rows(style, x, rank, world).clone().requires_grad_()
        out = model(xi)
        (out * local_rows(style, upstream, rank, world)).sum().backward()
        outputs[label], input_grads[label] = out, xi.grad
    x64 = x.double().requires_grad_()
    ref = full64(x64)
    (ref * upstream.double()).sum().backward()
    ref, x64_grad = local_rows(style, ref, rank, world), local_rows(style, x64.grad, rank, world)

    what = f"{style} bias={bias} {algorithm} rank {rank}"
    check(outputs["converted"], outputs["unfused"], 1e-5, what + " output vs unfused")
    check(outputs["converted"], ref, 1e-4, what + " output vs float64 block")
    check(input_grads["converted"], input_grads["unfused"], 1e-5, what + " input grad vs unfused")
    check(input_grads["converted"], x64_grad, 1e-4, what + " input grad vs float64 block")
    full_grads = {n: p.grad for n, p in full64.named_parameters()}
    unfused_params = dict(unfused.named_parameters())
    for name, p in converted.named_parameters():
        got = tp.local_tensor(p.grad)
        check(got, tp.local_tensor(unfused_params[name].grad), 1e-5, f"{what} grad {name} vs unfused")
        if any(placement.is_partial() for placement in getattr(p.grad, "placements", ())):
            # DTensor leaves a SequenceParallel norm's weight gradient Partial (each rank's share): its value is the sum
            got = p.grad.full_tensor()
        check(got, expected_local(name, full_grads[name], rank, world), 1e-4, f"{what} grad {name} vs float64")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("style", ["plain", "dtensor", "sp"])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_backward_match_unfused_and_float64(ranks, world, style, bias):
    # The sequence-parallel ops have no `chunked` (their collective is one phase already): fused twice instead.
    choices = ["sequential", "fused", "fused", "auto"] if style == "sp" else ["sequential", "chunked", "fused", "auto"]
    algorithm = choices[(2 * (world - 2) + bias) % 4]
    ranks(world).run(block_equivalence, random.randrange(1 << 30), style, bias, algorithm)


def training_steps(rank, world, seed, style, steps):
    cfg = tp.BlockConfig(**CONFIG, bias=True)
    full = tp.make_block(cfg, seed)
    unfused, converted = tensor_parallel(style, full, world), tensor_parallel(style, full, world)
    # SGD rather than Adam: Adam's normalisation would blow rounding-level gradient differences up to lr.
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for m in (unfused, converted)]
    # Converted after the optimizer was built: it must keep driving the same parameters.
    convert(style, converted, {"dtensor": "chunked", "plain": "sequential", "sp": "fused"}[style])
    g = torch.Generator().manual_seed(seed + 2)
    for _ in range(steps):
        x = local_rows(style, torch.randn(BATCH, seq_len(style, world), cfg.hidden, generator=g), rank, world)
        target = local_rows(style, torch.randn(BATCH, seq_len(style, world), cfg.hidden, generator=g), rank, world)
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


@pytest.mark.parametrize("style", ["plain", "dtensor", "sp"])
def test_training_steps_give_the_same_weights(ranks, style):
    ranks(2).run(training_steps, random.randrange(1 << 30), style, 3)
