"""What the model converters (replace_row_parallel, replace_column_parallel, replace_sequence_parallel) share: the
report they return, a module they may convert, name patterns, the checks of a plain layer's parameters and their
exchange between ranks, the refusal errors (torchtitan's models pointed to replace_torchtitan), and the size of a probe's random input."""
import fnmatch
import logging
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .._groups import GroupInfo
from .dtensor_row_parallel import read_transformers_style

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
class Candidate:
    names: List[str]  # every name the module is reachable under (a shared module has several)
    module: nn.Module
    dtensor: bool
    problems: List[str] = field(default_factory=list)
    layouts: object = None  # RowwiseLayouts for (a)


def reported(report: ReplaceReport) -> ReplaceReport:
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s", report)
    return report


def style_of(module: nn.Module) -> Optional[str]:
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


def modules_by_id(model: nn.Module) -> Tuple[Dict[int, List[str]], Dict[int, nn.Module]]:
    """Every module of `model` once, by id: every name it is reachable under (a shared module has several), and the
    module."""
    names_of: Dict[int, List[str]] = {}
    modules: Dict[int, nn.Module] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names_of.setdefault(id(module), []).append(name)
        modules[id(module)] = module
    return names_of, modules


def matches(name: str, patterns: Iterable[str]) -> bool:
    return bool(name) and any(fnmatch.fnmatchcase(name, p) for p in patterns)


def plain_problems(module: nn.Module, shard: str = "[out, in/world]", bias_role: str = "the full bias of the layer"
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


def share_problems(candidates: List[Candidate], info: GroupInfo) -> None:
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


def raise_if_problems(candidates: List[Candidate], who: str = "replace_row_parallel") -> None:
    lines = [f"  {c.names[0]!r} ({type(c.module).__name__}): {p}" for c in candidates for p in c.problems]
    if lines:
        raise ValueError(f"{who}: cannot replace\n" + "\n".join(lines))


def probe_close(got: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a probe's result matches a float32 reference, within what `dtype` rounds to."""
    tolerance = 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2
    return bool((got.float() - reference).abs().max() <= tolerance * (reference.abs().max() + 1.0))


def refuse_torchtitan(modules: Iterable[nn.Module], who: str) -> None:
    """A model that torchtitan's Module.parallelize parallelized has no style hooks for `who` to find: say which
    converter reads its sharding configs instead of "found nothing"."""
    if any(getattr(m, "_sharding_config", None) is not None for m in modules):
        raise ValueError(f"{who}: the model was parallelized by torchtitan's Module.parallelize (sharding configs, "
                         "no tensor-parallel style hooks): use torch_gemm_ar.nn.replace_torchtitan(model)")


def put_in_place(model: nn.Module, names: List[str], new: nn.Module) -> None:
    """Puts `new` where the module is reachable under every one of `names` (a shared module has several)."""
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, new)
