"""replace_sequence_parallel: the sibling of replace_row_parallel for DTensor plans with sequence parallelism.

A torch.distributed.tensor.parallel plan with sequence parallelism (SequenceParallel on the norms) runs
- ColwiseParallel(input_layouts=Shard(d)) linear layers: all-gather of the sequence shard, then the GEMM;
- RowwiseParallel(output_layouts=Shard(d)) linear layers: the GEMM, then a reduce-scatter back to sequence shards.
Each becomes a module that adopts the same Parameter objects (optimizers, hooks on parameters and state_dicts keep
working) and runs the pair as one op: DTensorColumnParallelLinear (allgather_gemm) and DTensorRowParallelLinear in
its reduce-scatter form (gemm_reduce_scatter). Inputs and outputs are what the parallelized module took and
returned (plain local tensors or DTensors, use_local_output honoured).
"""
import fnmatch
import sys
from typing import Optional, Sequence

from torch import nn

from .dtensor_column_parallel import DTensorColumnParallelLinear, colwise_problems
from .dtensor_row_parallel import DTensorRowParallelLinear, read_style_hooks, rowwise_problems, sequence_shard_dim
from .conversion import ReplaceReport, modules_by_id, put_in_place, refuse_torchtitan, reported, style_of
from .row_parallel_linear import check_algorithm

_CONVERTED = (DTensorRowParallelLinear, DTensorColumnParallelLinear)

# Why a module of another style has no sequence-parallel collective next to one GEMM.
_SKIP_REASONS = {
    "SequenceParallel": "a sequence-parallel module (norm or dropout) runs on its shard: no GEMM to fuse",
    "PrepareModuleInput": "reshards a parent module's inputs (e.g. an all-gather before several layers): not next to "
                          "one GEMM; put ColwiseParallel(input_layouts=Shard(d)) on the linear layers to fuse it",
    "PrepareModuleOutput": "only rearranges its outputs: no GEMM to fuse",
}


def _sequence_style(module: nn.Module):
    """("row" | "column", layouts, other_hooks) if `module` carries a sequence-parallel Rowwise/Colwise plan."""
    layouts, others, _ = read_style_hooks(module, "RowwiseParallel")
    if layouts is not None and sequence_shard_dim(layouts.output_layouts) is not None:
        return "row", layouts, others
    layouts, others, _ = read_style_hooks(module, "ColwiseParallel")
    if layouts is not None and sequence_shard_dim(layouts.input_layouts) is not None:
        return "column", layouts, others
    return None


def _skip_reason(module: nn.Module) -> Optional[str]:
    style = style_of(module)
    if style is None:
        return None
    if style == "RowwiseParallel":
        return ("RowwiseParallel with an all_reduce (output not sharded on the sequence): "
                "torch_gemm_ar.nn.replace_row_parallel converts it")
    if style == "ColwiseParallel":
        return "ColwiseParallel with a replicated input: no all-gather before its GEMM"
    return f"{style}: " + _SKIP_REASONS.get(style, "not a sequence-parallel GEMM")


def replace_sequence_parallel(model: nn.Module, *, patterns: Optional[Sequence[str]] = None,
                              algorithm: str = "auto") -> ReplaceReport:
    """Converts, in place, every nn.Linear of `model` parallelized with ColwiseParallel(input_layouts=Shard(d)) or
    RowwiseParallel(output_layouts=Shard(d)) (d a sequence dim, not the last) on a 1-D mesh; `patterns`
    (fnmatch on module names) restricts the conversion. Returns a ReplaceReport: the names replaced and, in
    `skipped`, every other tensor-parallel module with the reason (logged at INFO on `torch_gemm_ar.nn`). A matched
    module that cannot be converted (other hooks on it, uneven shards, a gathered output ...) is a ValueError
    naming it and the reason; nothing is converted then. Call it on every rank with the same model. Modules
    converted before are left alone.
    """
    check_algorithm(algorithm, "replace_sequence_parallel")
    if isinstance(patterns, str):
        patterns = [patterns]
    if patterns is not None and (not patterns or not all(isinstance(p, str) and p for p in patterns)):
        raise ValueError(f"replace_sequence_parallel: patterns must be non-empty strings; got {patterns!r}")
    if "torch.distributed.tensor" not in sys.modules:
        raise ValueError("replace_sequence_parallel: torch.distributed.tensor is not imported, so no module of the "
                         "model can be parallelized with DTensor")
    names_of, modules = modules_by_id(model)

    def selected(i: int) -> bool:
        return patterns is None or any(fnmatch.fnmatchcase(n, p) for n in names_of[i] for p in patterns)

    found, skipped = [], []
    for i, module in modules.items():
        if isinstance(module, _CONVERTED):
            continue
        style = _sequence_style(module)
        if style is not None and selected(i):
            found.append((i, *style))
        elif patterns is None and names_of[i][0]:
            reason = _skip_reason(module)
            if reason is not None:
                skipped.append((names_of[i][0], reason))
    if not found:
        if any(isinstance(m, _CONVERTED) for m in modules.values()):
            return reported(ReplaceReport([], skipped, converter="replace_sequence_parallel",
                                          ops="allgather_gemm / gemm_reduce_scatter"))
        refuse_torchtitan(modules.values(), "replace_sequence_parallel")
        raise ValueError("replace_sequence_parallel: found no nn.Linear parallelized with "
                         "ColwiseParallel(input_layouts=Shard(d)) or RowwiseParallel(output_layouts=Shard(d))"
                         + (f" matching {list(patterns)}" if patterns is not None else ""))

    problems = []
    for i, kind, layouts, others in found:
        module = modules[i]
        if kind == "row":
            found_problems = rowwise_problems(module, layouts, others, None, reduce_scatter=True)
        else:
            found_problems = colwise_problems(module, layouts, others)
        problems += [f"  {names_of[i][0]!r} ({type(module).__name__}): {p}" for p in found_problems]
    if problems:
        raise ValueError("replace_sequence_parallel: cannot replace\n" + "\n".join(problems))

    replaced = []
    for i, kind, layouts, _ in found:
        module = modules[i]
        cls = DTensorRowParallelLinear if kind == "row" else DTensorColumnParallelLinear
        new = cls(module, layouts, algorithm=algorithm)
        put_in_place(model, names_of[i], new)
        replaced += names_of[i]
    return reported(ReplaceReport(replaced, skipped, converter="replace_sequence_parallel",
                                  ops="allgather_gemm / gemm_reduce_scatter"))
