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
import fnmatch
import logging
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .._ops import GroupLike
from ._groups import GroupInfo, resolve_group
from ._probe_timeout import bounded_group_timeout, is_collective_failure
from .dtensor_column_parallel import DTensorColumnParallelLinear, read_colwise_style
from .dtensor_row_parallel import (
    DTensorRowParallelLinear, is_dtensor, read_rowwise_hooks, read_transformers_style,
    rowwise_problems, sequence_shard_dim,
)
from .row_parallel_linear import RowParallelLinear, check_algorithm

PROBE_ROWS = 5
PROBE_SEED = 0x5EED
logger = logging.getLogger("torch_gemm_ar.nn")


class ReplaceReport(list):
    """What a converter (replace_row_parallel, replace_column_parallel, replace_sequence_parallel) did: the list of
    the names it replaced (compares equal to a plain list) and `skipped`, the (name, reason) of every other
    tensor-parallel module it saw. `str(report)` explains both."""

    def __init__(self, replaced: Iterable[str] = (), skipped: Iterable = (), *,
                 converter: str = "replace_row_parallel", ops: str = "gemm_allreduce"):
        super().__init__(replaced)
        self.skipped = list(skipped)
        self.converter, self.ops = converter, ops

    def __str__(self) -> str:
        lines = [f"{self.converter}: replaced {len(self)} module(s) with {self.ops}"
                 + (": " + ", ".join(self) if self else "")]
        by_reason: Dict[str, List[str]] = {}
        for name, reason in self.skipped:
            by_reason.setdefault(reason, []).append(name)
        for reason, names in by_reason.items():
            shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
            lines.append(f"  skipped {shown}: {reason}")
        return "\n".join(lines)

    __repr__ = list.__repr__


@dataclass
class _Candidate:
    names: List[str]  # every name the module is reachable under (a shared module has several)
    module: nn.Module
    dtensor: bool
    problems: List[str] = field(default_factory=list)
    layouts: object = None  # RowwiseLayouts for (a)


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
        return _reported(ReplaceReport([], skipped))
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
            c.problems += _plain_problems(c.module)
    if plain:
        # Local findings may differ between ranks; share them before any probe so all ranks raise together.
        _share_problems(candidates, info)
    _raise_if_problems(candidates)
    if plain:
        _probe_all(plain, info)
        _raise_if_problems(candidates)

    replaced: List[str] = []
    for c in candidates:
        if c.dtensor:
            new = DTensorRowParallelLinear(c.module, c.layouts, algorithm=algorithm)
        else:
            new = RowParallelLinear._around(c.module.weight, c.module.bias, info, algorithm)
        for name in c.names:
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name), leaf, new)
            replaced.append(name)
    return _reported(ReplaceReport(replaced, skipped))


def _reported(report: ReplaceReport) -> ReplaceReport:
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s", report)
    return report


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


def _style_of(module: nn.Module) -> Optional[str]:
    """The class name of the tensor-parallel style applied to `module` (transformers' or torch's), else None."""
    found = read_transformers_style(module)
    if found is not None:
        return type(found[0]).__name__
    for hook in list(module._forward_pre_hooks.values()) + list(module._forward_hooks.values()):
        for cell in getattr(hook, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            func = getattr(value, "func", None)  # distribute_module's hooks close over partials of style methods
            qualname = getattr(func, "__qualname__", "")
            if "." in qualname and getattr(func, "__module__", "").startswith("torch.distributed.tensor"):
                return qualname.split(".")[0]
    return None


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
        style = _style_of(module)
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


def modules_by_id(model: nn.Module) -> Tuple[Dict[int, List[str]], Dict[int, nn.Module]]:
    """Every module of `model` once, by id: every name it is reachable under (a shared module has several), and the
    module."""
    names_of: Dict[int, List[str]] = {}
    modules: Dict[int, nn.Module] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names_of.setdefault(id(module), []).append(name)
        modules[id(module)] = module
    return names_of, modules


def _select(model: nn.Module, patterns: Optional[Sequence[str]]) -> List[_Candidate]:
    names_of, modules = modules_by_id(model)
    converted = (RowParallelLinear, DTensorRowParallelLinear, DTensorColumnParallelLinear)

    if patterns is None:
        found = [i for i, m in modules.items() if not isinstance(m, converted) and read_rowwise_hooks(m)[0] is not None]
        if not found:
            if any(isinstance(m, converted) for m in modules.values()):
                return []  # converted by an earlier call
            raise ValueError(
                "replace_row_parallel: found no module parallelized with RowwiseParallel (DTensor: torch's "
                "parallelize_module or transformers' tp_plan); for a plain "
                "tensor-parallel model pass patterns=[...] naming its row-parallel layers, e.g. ['*.o_proj', "
                "'*.down_proj']"
            )
        return [_Candidate(names_of[i], modules[i], dtensor=True) for i in found]

    patterns = list(patterns)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"replace_row_parallel: patterns must be non-empty strings; got {patterns!r}")
    unmatched = [p for p in patterns if not any(_matches(n, [p]) for names in names_of.values() for n in names)]
    if unmatched:
        raise ValueError(f"replace_row_parallel: pattern(s) {unmatched} match no module of the model")
    candidates = []
    for i, module in modules.items():
        names = names_of[i]
        if not any(_matches(n, patterns) for n in names) or isinstance(module, converted):
            continue
        has_dtensor = any(is_dtensor(p) for p in module.parameters()) or read_rowwise_hooks(module)[0] is not None
        candidates.append(_Candidate(names, module, dtensor=has_dtensor))
    return candidates


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return bool(name) and any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _plain_problems(module: nn.Module, shard: str = "[out, in/world]", bias_role: str = "the full bias of the layer"
                    ) -> List[str]:
    """Why a plain module cannot be a tensor-parallel linear layer: weight `shard` (row-parallel: [out, in/world]),
    optional bias of the weight's first dimension (`bias_role`)."""
    problems = []
    hooks = [kind for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
             if getattr(module, kind, None)]
    if hooks:
        problems.append(f"it has hooks ({', '.join(h.strip('_') for h in hooks)}) that a replacement would drop")
    own = dict(module.named_parameters(recurse=False))
    extra = [n for n, _ in module.named_parameters() if n not in ("weight", "bias")]
    if extra:
        problems.append(f"it is not a single linear layer: it has parameters {extra}")
    buffers = [n for n, _ in module.named_buffers()]
    if buffers:
        problems.append(f"it has buffers {buffers} that the fused layer would drop")
    weight = own.get("weight")
    if weight is None:
        problems.append(f"it is a {type(module).__name__} without a weight parameter: not a linear layer")
        return problems
    if weight.dim() != 2 or not weight.is_floating_point():
        problems.append(f"its weight is {weight.dim()}-D {weight.dtype}; expected a 2-D floating {shard} shard")
        return problems
    bias = getattr(module, "bias", None)
    if bias is not None:
        if own.get("bias") is not bias:
            problems.append("its bias is not a parameter of the module")
        elif tuple(bias.shape) != (weight.shape[0],) or bias.dtype != weight.dtype:
            problems.append(f"its bias is {tuple(bias.shape)} {bias.dtype}; expected [{weight.shape[0]}] "
                            f"{weight.dtype}, {bias_role}")
    return problems


def _signature(module: nn.Module):
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    if not isinstance(weight, torch.Tensor):
        return None
    return (tuple(weight.shape), str(weight.dtype), None if not isinstance(bias, torch.Tensor) else tuple(bias.shape))


def _share_problems(candidates: List[_Candidate], info: GroupInfo) -> None:
    """Every rank learns every rank's problems, and that all ranks hold shards of the same shapes."""
    local = [(c.problems, _signature(c.module) if not c.dtensor else None) for c in candidates]
    gathered = [None] * info.world
    dist.all_gather_object(gathered, local, group=info.group)
    for index, c in enumerate(candidates):
        merged = list(c.problems)
        for rank, entries in enumerate(gathered):
            problems, _ = entries[index]
            merged += [f"on rank {rank}: {p}" for p in problems if p not in c.problems]
        signatures = {rank: entries[index][1] for rank, entries in enumerate(gathered)}
        if len(set(signatures.values())) > 1:
            merged.append("ranks disagree on its shapes (weight shape, dtype, bias shape): " +
                          ", ".join(f"rank {r}: {s}" for r, s in signatures.items()))
        c.problems = merged


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
    tolerance = 1e-4 if weight.dtype in (torch.float32, torch.float64) else 5e-2

    def close(reference: torch.Tensor) -> bool:
        return bool((out.float() - reference).abs().max() <= tolerance * (reference.abs().max() + 1.0))

    if close(reduced + bias32):
        return "reduced"
    if close(partial + bias32):
        return "partial"
    if bias is not None and close(reduced + info.world * bias32):
        return "bias-per-rank"
    return "other"


def _probe_bounded(c: _Candidate, info: GroupInfo) -> str:
    """_probe with its collectives bounded (_probe_timeout.py). A forward that raises on this rank raises here at
    once; a collective that fails or times out on this rank (a peer's forward raised, or the layer reduces over a
    group some rank does not call) raises naming the module too. Either way every rank raises; the group is then
    unusable, as after any collective that one rank abandoned."""
    with bounded_group_timeout(info.group) as bound_s:
        try:
            return _probe(c.module, info)
        except Exception as exc:
            if not is_collective_failure(exc):
                raise _forward_raised(c, info, exc, bound_s) from exc
            bound = "its group's timeout" if bound_s is None else f"{bound_s:g} s"
            raise RuntimeError(
                f"replace_row_parallel: probing {c.names[0]!r} ({type(c.module).__name__}) on rank {info.rank}: a "
                f"collective failed or waited past {bound} (TORCH_GEMM_AR_PROBE_TIMEOUT_S): another rank's forward "
                f"of it probably raised (see that rank's error); {type(exc).__name__}: {exc}") from exc


def _forward_raised(c: _Candidate, info: GroupInfo, exc: Exception, bound_s) -> ValueError:
    return ValueError(
        f"replace_row_parallel: cannot replace {c.names[0]!r} ({type(c.module).__name__}): its forward raised "
        f"{type(exc).__name__}: {exc} on rank {info.rank} while being probed with a random "
        f"[{PROBE_ROWS}, {c.module.weight.shape[1]}] input; ranks whose forward did not raise wait at most "
        f"{'their group timeout' if bound_s is None else f'{bound_s:g} s'} in its collectives, then raise too")


def _probe_all(plain: List[_Candidate], info: GroupInfo) -> None:
    local = [_probe_bounded(c, info) for c in plain]
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


def _raise_if_problems(candidates: List[_Candidate], who: str = "replace_row_parallel") -> None:
    lines = [f"  {c.names[0]!r} ({type(c.module).__name__}): {p}" for c in candidates for p in c.problems]
    if lines:
        raise ValueError(f"{who}: cannot replace\n" + "\n".join(lines))
