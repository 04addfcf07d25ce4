"""replace_column_parallel: swap the column-parallel layers of a tensor-parallel model for ones whose backward fuses
the input gradient's all-reduce with its GEMM (gemm_allreduce), for training.

(a) an nn.Linear parallelized by torch.distributed.tensor.parallel.ColwiseParallel (or transformers' tp_plan
    "colwise") with a replicated input (the default input_layouts=Replicate(), output Shard(-1)): becomes a
    DTensorColumnParallelLinear (same Parameter objects, inputs and outputs). Found automatically (patterns=None) or
    by pattern; the group is the mesh's.
(b) a plain (non-DTensor) column-parallel layer selected by a name pattern: a module holding this rank's
    `[out/world, in]` weight shard (and optionally its `[out/world]` bias shard) whose forward returns one tensor, the
    local `x @ weight.T + bias` on the replicated input, and whose backward all-reduces the input gradient over
    `group` -- the Megatron-style layer (copy_to_tensor_model_parallel_region, then the GEMM, gather_output=False).
    It becomes a ColumnParallelLinear that adopts the same Parameter objects, so optimizers built before, gradient
    hooks and state_dicts keep working. Each matched module is probed once, on all ranks together, forward and
    backward with random values, and anything else is an error on every rank, with the reason (a bare nn.Linear shard
    whose input gradient the model reduces elsewhere, a layer that gathers its output or returns (output, bias)
    pairs, another group, extra computation).
"""
import sys
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .._ops import GroupLike
from .._groups import GroupInfo, resolve_group
from .column_parallel_linear import ColumnParallelLinear
from .dtensor_column_parallel import DTensorColumnParallelLinear, colwise_problems, read_colwise_style
from .dtensor_row_parallel import is_dtensor
from ._probe_timeout import run_bounded_probe
from .conversion import (
    PROBE_ROWS, PROBE_SEED, Candidate, ReplaceReport, matches, modules_by_id, plain_problems, probe_close,
    put_in_place, raise_if_problems, refuse_torchtitan, reported, share_problems,
)
from .row_parallel_linear import check_algorithm

WHO = "replace_column_parallel"
OPS = "gemm_allreduce in backward"


def replace_column_parallel(
    model: nn.Module,
    *,
    patterns: Union[None, str, Sequence[str]] = None,
    group: GroupLike = None,
    algorithm: str = "auto",
) -> ReplaceReport:
    """Replace the column-parallel layers of `model` in place; returns the names replaced (a ReplaceReport, with
    `skipped`: what was left alone and why; also logged on the "torch_gemm_ar.nn" logger).

    patterns=None: every nn.Linear parallelized with torch's ColwiseParallel or transformers' tp_plan "colwise" on a
    replicated input (DTensor); other
    ColwiseParallel modules (a gathered output, sequence parallelism, an nn.Embedding) are left alone and listed in
    `skipped`. With patterns (fnmatch on the qualified module name, e.g. "*.q_proj", "layers.*.mlp.up_proj"):
    exactly the modules they match, DTensor or plain, and any of them that cannot be converted is an error; a
    pattern that matches nothing is an error. `group`: for plain layers the group whose input-gradient all-reduce
    they run (None: the default group); for DTensor layers it may be left None (the mesh's group is used) and
    otherwise must be that group. Call it on every rank of the group with the same model and arguments (plain
    layers are probed collectively). Layers converted before are left alone and not listed again."""
    check_algorithm(algorithm, WHO)
    if isinstance(patterns, str):
        patterns = [patterns]
    if patterns is not None:
        if not isinstance(patterns, (list, tuple)) or not patterns or \
                not all(isinstance(p, str) and p for p in patterns):
            raise ValueError(f"{WHO}: patterns must be a non-empty list of non-empty strings naming the "
                             f"column-parallel layers, e.g. ['*.q_proj', '*.up_proj']; got {patterns!r}")
        patterns = list(patterns)
    candidates = _select(model, patterns)
    plain = [c for c in candidates if not c.dtensor]
    info = resolve_group(group, WHO) if plain or group is not None else None
    for c in candidates:
        if c.dtensor:
            c.layouts, other_hooks, _ = read_colwise_style(c.module)
            c.problems += colwise_problems(c.module, c.layouts, other_hooks, None if group is None else info.name,
                                           replicated_input=True)
        else:
            c.problems += plain_problems(c.module, "[out/world, in]", "the bias shard of the layer")
    skipped: List[Tuple[str, str]] = []
    if patterns is None:
        # Found by their style, not named: the ones that cannot be converted are reported, not errors.
        skipped = [(c.names[0], "ColwiseParallel: " + "; ".join(c.problems)) for c in candidates if c.problems]
        candidates = [c for c in candidates if not c.problems]
    if plain:
        # Local findings may differ between ranks; share them before any probe so all ranks raise together.
        share_problems(candidates, info)
    raise_if_problems(candidates, WHO)
    if plain:
        _probe_all(plain, info)
        raise_if_problems(candidates, WHO)

    replaced: List[str] = []
    for c in candidates:
        if c.dtensor:
            new = DTensorColumnParallelLinear(c.module, c.layouts, algorithm=algorithm)
        else:
            new = ColumnParallelLinear._around(c.module.weight, getattr(c.module, "bias", None), info, algorithm,
                                               sequence_parallel=False)
        put_in_place(model, c.names, new)
        replaced += c.names
    return reported(ReplaceReport(replaced, skipped, converter=WHO, ops=OPS))


def _has_colwise_style(module: nn.Module) -> bool:
    """Whether torch's or transformers' ColwiseParallel is on `module` (any layouts)."""
    if "torch.distributed.tensor" not in sys.modules:
        return False  # nothing can be parallelized with DTensor before it is imported
    return read_colwise_style(module)[0] is not None


def _select(model: nn.Module, patterns: Optional[List[str]]) -> List[Candidate]:
    names_of, modules = modules_by_id(model)
    converted = (ColumnParallelLinear, DTensorColumnParallelLinear)
    if patterns is None:
        found = [i for i, m in modules.items() if not isinstance(m, converted) and _has_colwise_style(m)]
        if not found and not any(isinstance(m, converted) for m in modules.values()):
            refuse_torchtitan(modules.values(), WHO)
            raise ValueError(f"{WHO}: found no module parallelized with ColwiseParallel (torch's DTensor hooks or "
                             "transformers' tp_plan \"colwise\" styles); for a plain tensor-parallel model pass "
                             "patterns=[...] naming its column-parallel layers, e.g. ['*.q_proj', '*.k_proj', "
                             "'*.v_proj', '*.gate_proj', '*.up_proj']")
        return [Candidate(names_of[i], modules[i], dtensor=True) for i in found]
    unmatched = [p for p in patterns if not any(matches(n, [p]) for names in names_of.values() for n in names)]
    if unmatched:
        raise ValueError(f"{WHO}: pattern(s) {unmatched} match no module of the model")
    candidates = []
    for i, module in modules.items():
        if not any(matches(n, patterns) for n in names_of[i]) or isinstance(module, converted):
            continue
        dtensor = any(is_dtensor(p) for p in module.parameters()) or read_colwise_style(module)[2]
        candidates.append(Candidate(names_of[i], module, dtensor=dtensor))
    return candidates


def _probe_forward(module: nn.Module):
    """(x, out, status) of `module` on a random input, the same on every rank (a column-parallel layer's input is
    replicated): status "ok", or "other: ..." when the forward raised or returned something else."""
    weight = module.weight
    x = torch.randn(PROBE_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(PROBE_SEED))
    x = x.to(device=weight.device, dtype=weight.dtype).requires_grad_()
    try:
        with torch.enable_grad():
            out = module(x)
    except Exception as e:  # reported on every rank below, instead of leaving the others in a collective
        return x, None, f"other: its forward raised {type(e).__name__}: {e}"
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (PROBE_ROWS, weight.shape[0]):
        described = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return x, None, (f"other: it returns {described}, not one [{PROBE_ROWS}, {weight.shape[0]}] tensor (this "
                         "rank's columns)")
    if not out.requires_grad:
        return x, None, "other: its output does not depend on its input through autograd"
    return x, out, "ok"


def _probe_backward(module: nn.Module, x: torch.Tensor, out: torch.Tensor, info: GroupInfo) -> str:
    """What the module's backward gives x for a random per-rank output gradient: "column" (all-reduced over the
    group), "local-grad" (this rank's part only), "not-local" (its forward was not the local product) or
    "other: ...". Collective in most layers: every rank runs it, and only for modules whose forward passed on all."""
    weight, bias = module.weight, getattr(module, "bias", None)
    generator = torch.Generator().manual_seed(PROBE_SEED + 1 + info.rank)  # a different gradient on every rank
    upstream = torch.randn(PROBE_ROWS, weight.shape[0], generator=generator)
    upstream = upstream.to(device=weight.device, dtype=weight.dtype)
    def close(got: torch.Tensor, reference: torch.Tensor) -> bool:
        return probe_close(got, reference, weight.dtype)

    (grad_x,) = torch.autograd.grad(out, [x], upstream, allow_unused=True)
    with torch.no_grad():
        bias32 = torch.zeros(weight.shape[0], device=weight.device) if bias is None else bias.float()
        local_out = F.linear(x.float(), weight.float()) + bias32
        local_grad = upstream.float() @ weight.float()
        reduced_grad = local_grad.clone()
        dist.all_reduce(reduced_grad, group=info.group)
    if not close(out.detach(), local_out):
        return "not-local"
    if grad_x is None:
        return "other: its output does not depend on its input through autograd"
    if close(grad_x, reduced_grad):
        return "column"
    if close(grad_x, local_grad):
        return "local-grad"
    return "other: its input gradient is neither all_reduce(grad @ weight) over the group nor this rank's part of it"


def _probe_all(candidates: List[Candidate], info: GroupInfo) -> None:
    """Probes every candidate on all ranks: forwards first, their statuses shared, then the backwards (collective)
    only where every rank's forward passed, so that a module that fails on one rank leaves no rank waiting. The
    parameters need no gradient meanwhile: the probe computes x's gradient only and touches nothing else (no .grad,
    no gradient written elsewhere by a custom backward)."""
    params = [p for c in candidates for p in c.module.parameters()]
    needed = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        forwards = [_probe_forward(c.module) for c in candidates]
        statuses = [None] * info.world
        dist.all_gather_object(statuses, [status for _, _, status in forwards], group=info.group)
        local = []
        for index, (c, (x, out, _)) in enumerate(zip(candidates, forwards)):
            failed = [(r, entries[index]) for r, entries in enumerate(statuses) if entries[index] != "ok"]
            if failed:
                rank, status = failed[0]
                local.append(status + ("" if len(failed) == info.world else f" (on rank {rank})"))
            else:
                local.append(run_bounded_probe(lambda: _probe_backward(c.module, x, out, info), WHO, c.names[0],
                                               c.module, info.rank, info.group, stage="backward"))
    finally:
        for p, was in zip(params, needed):
            p.requires_grad_(was)
    gathered = [None] * info.world
    dist.all_gather_object(gathered, local, group=info.group)
    group_text = f"group {info.name!r} (size {info.world})"
    for index, c in enumerate(candidates):
        verdicts = [entries[index] for entries in gathered]
        if len(set(verdicts)) > 1:
            c.problems.append("ranks disagree on what it computes (" +
                              ", ".join(f"rank {r}: {v}" for r, v in enumerate(verdicts)) +
                              f"): not a column-parallel layer over {group_text} -- is the group right?")
            continue
        verdict = verdicts[0]
        if verdict == "local-grad":
            c.problems.append(
                "its backward leaves the input gradient as this rank's part (grad @ weight), not its all_reduce: the "
                "model reduces it elsewhere (a bare nn.Linear shard), and an all_reduce written outside the module "
                "cannot be removed from here. Make the layer own it (Megatron-LM's "
                "copy_to_tensor_model_parallel_region inside the layer), or put "
                "torch_gemm_ar.nn.ColumnParallelLinear(sequence_parallel=False) in its place and delete that "
                "all_reduce")
        elif verdict == "not-local":
            c.problems.append(
                "its output on a replicated random input is not this rank's x @ weight.T (+ bias): not a "
                "column-parallel layer with gather_output=False (it gathers or reduces its output, or computes more)")
        elif verdict.startswith("other: "):
            c.problems.append(verdict.partition(": ")[2] + f"; not a column-parallel linear layer over {group_text}")


__all__ = ["replace_column_parallel"]
