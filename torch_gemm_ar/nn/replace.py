"""replace_row_parallel: swap the row-parallel matmul + all_reduce of an existing model for gemm_allreduce.

Two kinds of modules are taken over, always by a module that adopts the *same Parameter objects* under the same
names (`weight`, `bias`), so optimizers built before the conversion, gradient hooks and state_dicts keep working:

(a) an nn.Linear parallelized by torch.distributed.tensor.parallel.RowwiseParallel (DTensor), or by
    transformers' RowwiseParallel through a model's `tp_plan` ("rowwise", "rowwise_split_input", "rowwise_rep"):
    becomes a DTensorRowParallelLinear that takes and returns exactly what the module took and returned
    (input_layouts, use_local_output honoured). Found automatically (patterns=None) or by pattern. The group is the
    mesh's. The other parallelized modules are listed in the report's `skipped`, each with the reason.

(b) a plain (non-DTensor) row-parallel layer selected by a name pattern: a module holding this rank's
    `[out, in/world]` weight shard (and optionally the full `[out]` bias) whose forward returns the all-reduced
    product with the bias added once -- the row-parallel layer of Megatron-LM, vLLM or DeepSpeed (matmul, then
    all_reduce over `group`, then bias). It becomes a RowParallelLinear over `group`; the model computes what it
    computed before. Each matched module is probed once, on all ranks together, with a random input, and anything
    else is an error on every rank, with the reason:
    - a bare nn.Linear shard whose all_reduce the model runs after it (it returns this rank's partial product):
      the converter cannot delete an all_reduce written elsewhere, and a column-parallel layer looks the same.
      Either make the layer own its all_reduce, or put RowParallelLinear in its place and delete that all_reduce;
    - a layer that reduces over another group, adds its bias on every rank, returns (output, bias) pairs, or
      computes anything else.
"""
import sys
from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .._ops import GroupLike
from .._groups import GroupInfo, resolve_group
from ._probe_timeout import run_bounded_probe
from .conversion import (
    PROBE_ROWS, PROBE_SEED, Candidate, ReplaceReport, matches, modules_by_id, plain_problems, probe_close,
    put_in_place, raise_if_problems, refuse_torchtitan, reported, share_problems, style_of,
)
from .dtensor_column_parallel import DTensorColumnParallelLinear, read_colwise_style
from .dtensor_row_parallel import (
    DTensorRowParallelLinear, is_dtensor, read_rowwise_hooks, read_transformers_style,
    rowwise_problems, sequence_shard_dim,
)
from .row_parallel_linear import RowParallelLinear, check_algorithm


def replace_row_parallel(
    model: nn.Module,
    *,
    group: GroupLike = None,
    patterns: Union[None, str, Sequence[str]] = None,
    algorithm: str = "auto",
) -> ReplaceReport:
    """Replace the row-parallel layers of `model` in place; returns the names replaced (a ReplaceReport: a list
    with `.skipped`, what was left alone and why; also logged on the "torch_gemm_ar.nn" logger).

    patterns=None: every nn.Linear parallelized with RowwiseParallel (DTensor: torch's parallelize_module, or
    transformers' tp_plan styles "rowwise", "rowwise_split_input", "rowwise_rep"). With patterns (fnmatch on the
    qualified module name, e.g. "*.o_proj", "layers.*.mlp.down_proj"): exactly the modules they match, DTensor or
    plain; a pattern that matches nothing is an error. `group`: for plain layers the group whose all_reduce they
    replace (None: the default group); for DTensor layers it may be left None (the mesh's group is used) and
    otherwise must be that group. Call it on every rank of the group with the same model and arguments (plain
    layers are probed collectively). Layers converted before are left alone and not listed again.
    """
    check_algorithm(algorithm, "replace_row_parallel")
    if isinstance(patterns, str):
        patterns = [patterns]
    candidates = _select(model, patterns)
    taken = {id(c.module) for c in candidates}
    skipped = [] if patterns is not None else _skipped(model, taken)
    if not candidates:
        return reported(ReplaceReport([], skipped))
    plain = [c for c in candidates if not c.dtensor]
    # Plain layers need the group (None: the default one); DTensor layers only check a group that was given.
    info = resolve_group(group, "replace_row_parallel") if plain or group is not None else None
    group_name = None if group is None else info.name

    for c in candidates:
        if c.dtensor:
            layouts, other_hooks = read_rowwise_hooks(c.module)
            c.layouts = layouts
            c.problems += rowwise_problems(c.module, layouts, other_hooks, group_name)
        else:
            c.problems += plain_problems(c.module)
    if plain:
        # Local findings may differ between ranks; share them before any probe so all ranks raise together.
        share_problems(candidates, info)
    raise_if_problems(candidates)
    if plain:
        _probe_all(plain, info)
        raise_if_problems(candidates)

    replaced: List[str] = []
    for c in candidates:
        if c.dtensor:
            new = DTensorRowParallelLinear(c.module, c.layouts, algorithm=algorithm)
        else:
            new = RowParallelLinear._around(c.module.weight, c.module.bias, info, algorithm)
        put_in_place(model, c.names, new)
        replaced += c.names
    return reported(ReplaceReport(replaced, skipped))


# Why a module parallelized with another style is not a GEMM followed by an all_reduce (style class names of
# torch.distributed.tensor.parallel and transformers.distributed.tensor_parallel).
_STYLE_REASONS = {
    "ColwiseParallel": "column-parallel: its GEMM is followed by no reduction",
    "PackedColwiseParallel": "column-parallel (packed weights): its GEMM is followed by no reduction",
    "PackedRowwiseParallel": "packed row-parallel parameters without a forward of their own to fuse",
    "SequenceParallel": "a sequence-parallel module (a norm or dropout): no GEMM to fuse",
    "PrepareModuleInput": "only rearranges its inputs: no GEMM to fuse",
    "PrepareModuleOutput": "only rearranges its outputs: no GEMM to fuse",
    "AllReduceParallel": "its all_reduce follows the whole module's forward, not one linear layer's GEMM",
    "MoeExpertsParallel": "expert MLPs: the all_reduce follows several expert GEMMs and the routing, not one GEMM",
    "MoeIdentityParallel": "an identity expert: no GEMM to fuse",
    "ReplicatedWithGradAllReduce": "replicated parameters whose gradients are all-reduced: no GEMM + all_reduce "
                                   "in forward",
    "MlaKvAProjParallel": "a replicated projection (its all-reduce is in backward only)",
    "LocalParamsParallel": "runs on local parameters without a collective",
}


def _colwise_pointer(module: nn.Module) -> str:
    """Which converter fuses a collective of the ColwiseParallel on `module` (torch's or transformers'), by its
    layouts ("" if none)."""
    from torch.distributed.tensor import Replicate, Shard

    layouts = read_colwise_style(module)[0]
    if layouts is None or tuple(layouts.output_layouts) != (Shard(-1),):
        return ""
    if sequence_shard_dim(layouts.input_layouts) is not None:  # replace_sequence_parallel reads torch's hooks only
        return "" if read_transformers_style(module) is not None else (
            " (its all-gather of the sequence before the GEMM: replace_sequence_parallel fuses it)")
    if tuple(layouts.input_layouts) == (Replicate(),):
        return " (its backward all-reduce of the input gradient: replace_column_parallel fuses it)"
    return ""


def _skipped(model: nn.Module, taken) -> List:
    """(name, reason) of every tensor-parallel module that is not a row-parallel candidate."""
    if "torch.distributed.tensor" not in sys.modules:
        return []  # nothing can be parallelized without it (see dtensor_row_parallel)
    converted = (RowParallelLinear, DTensorRowParallelLinear, DTensorColumnParallelLinear)
    skipped = []
    for name, module in model.named_modules():
        if id(module) in taken or isinstance(module, converted):
            continue
        style = style_of(module)
        if style is not None:
            reason = _STYLE_REASONS.get(style, f"its style {style} does not end a GEMM with an all_reduce")
            found = read_transformers_style(module)
            if style == "ColwiseParallel" and found is not None and found[0].output_layouts.is_replicate():
                reason = "column-parallel with a gathered output: an all-gather follows its GEMM, not an all_reduce"
            if style == "ColwiseParallel":
                reason += _colwise_pointer(module)
            if style == "EmbeddingParallel" and found is not None:
                reason = ("a vocabulary-parallel embedding: its all_reduce follows a lookup, not a GEMM"
                          if found[0].shard_dim == 0 else "a hidden-parallel embedding: an all-gather, no GEMM")
            skipped.append((name, f"{style}: {reason}"))
        elif any(is_dtensor(p) for p in module.parameters(recurse=False)):
            placements = sorted({str(tuple(p.placements)) for p in module.parameters(recurse=False) if is_dtensor(p)})
            skipped.append((name, f"DTensor parameters {', '.join(placements)} without a row-parallel style"))
    return skipped


def _select(model: nn.Module, patterns: Optional[Sequence[str]]) -> List[Candidate]:
    names_of, modules = modules_by_id(model)
    converted = (RowParallelLinear, DTensorRowParallelLinear, DTensorColumnParallelLinear)

    if patterns is None:
        found = [i for i, m in modules.items() if not isinstance(m, converted) and read_rowwise_hooks(m)[0] is not None]
        if not found:
            if any(isinstance(m, converted) for m in modules.values()):
                return []  # converted by an earlier call
            refuse_torchtitan(modules.values(), "replace_row_parallel")
            raise ValueError(
                "replace_row_parallel: found no module parallelized with RowwiseParallel (DTensor: torch's "
                "parallelize_module or transformers' tp_plan); for a plain "
                "tensor-parallel model pass patterns=[...] naming its row-parallel layers, e.g. ['*.o_proj', "
                "'*.down_proj']"
            )
        return [Candidate(names_of[i], modules[i], dtensor=True) for i in found]

    patterns = list(patterns)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"replace_row_parallel: patterns must be non-empty strings; got {patterns!r}")
    unmatched = [p for p in patterns if not any(matches(n, [p]) for names in names_of.values() for n in names)]
    if unmatched:
        raise ValueError(f"replace_row_parallel: pattern(s) {unmatched} match no module of the model")
    candidates = []
    for i, module in modules.items():
        names = names_of[i]
        if not any(matches(n, patterns) for n in names) or isinstance(module, converted):
            continue
        has_dtensor = any(is_dtensor(p) for p in module.parameters()) or read_rowwise_hooks(module)[0] is not None
        candidates.append(Candidate(names, module, dtensor=has_dtensor))
    return candidates


def _probe(module: nn.Module, info: GroupInfo) -> str:
    """What `module` returns for a random input: "reduced", "partial", "bias-per-rank" or "other: ...".
    Its own generator keeps the global RNG state untouched."""
    weight, bias = module.weight, module.bias
    generator = torch.Generator().manual_seed(PROBE_SEED + info.rank)
    x = torch.randn(PROBE_ROWS, weight.shape[1], generator=generator).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        out = module(x)
        partial = F.linear(x.float(), weight.float())
        reduced = partial.clone()
        dist.all_reduce(reduced, group=info.group)
        bias32 = torch.zeros(weight.shape[0], device=weight.device) if bias is None else bias.float()
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(reduced.shape):
        described = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return f"other: it returns {described}, not one [{PROBE_ROWS}, {weight.shape[0]}] tensor"
    def close(reference: torch.Tensor) -> bool:
        return probe_close(out, reference, weight.dtype)

    if close(reduced + bias32):
        return "reduced"
    if close(partial + bias32):
        return "partial"
    if bias is not None and close(reduced + info.world * bias32):
        return "bias-per-rank"
    return "other"


def _probe_all(plain: List[Candidate], info: GroupInfo) -> None:
    local = [run_bounded_probe(lambda: _probe(c.module, info), "replace_row_parallel", c.names[0], c.module,
                               info.rank, info.group) for c in plain]
    gathered = [None] * info.world
    dist.all_gather_object(gathered, local, group=info.group)
    for index, c in enumerate(plain):
        verdicts = [entries[index] for entries in gathered]
        group_text = f"group {info.name!r} (size {info.world})"
        if len(set(verdicts)) > 1:
            c.problems.append(
                "ranks disagree on what it computes (" + ", ".join(f"rank {r}: {v}" for r, v in enumerate(verdicts))
                + f"): it does not all_reduce over {group_text} -- is the group right?")
            continue
        verdict = verdicts[0]
        if verdict == "partial":
            c.problems.append(
                "it returns this rank's partial product x @ weight.T, not its all_reduce: the model reduces it "
                "elsewhere (or it is column-parallel), and an all_reduce written outside the module cannot be "
                "removed from here. Make the layer own its all_reduce (matmul, all_reduce, bias, as Megatron-LM "
                "and vLLM do), or put torch_gemm_ar.nn.RowParallelLinear in its place and delete that all_reduce")
        elif verdict == "bias-per-rank":
            c.problems.append(f"it adds its bias on every rank before the all_reduce ({info.world} times in "
                              "total), while the fused layer adds it once")
        elif verdict.startswith("other: "):
            c.problems.append(verdict.partition(": ")[2] + "; not a row-parallel linear layer")
        elif verdict == "other":
            c.problems.append(
                f"its output on a random input is neither its all_reduce of x @ weight.T (+ bias) over {group_text} "
                "nor this rank's partial product: not a row-parallel linear layer over this group (wrong group, or "
                "extra computation)")

