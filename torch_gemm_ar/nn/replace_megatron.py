"""replace_megatron: swap Megatron-core's tensor-parallel linear layers for the fused ones, found by their types.

- megatron.core.tensor_parallel.RowParallelLinear (input_is_parallel=True): its GEMM and the all-reduce of its
  output become one gemm_allreduce (MegatronRowParallelLinear); with sequence parallelism its GEMM and the
  reduce-scatter along the sequence (dim 0, Megatron's [s, b, h]) become one gemm_reduce_scatter.
- megatron.core.tensor_parallel.ColumnParallelLinear (gather_output=False, its input gradient all-reduced): forward is
  its local GEMM as before, backward fuses the input gradient's all-reduce with the GEMM that produces it
  (MegatronColumnParallelLinear); with sequence parallelism the all-gather of the sequence and the GEMM become one
  allgather_gemm (backward reduce-scatters the input gradient, as Megatron does).

Both adopt the layer's own Parameter objects (optimizers built before, Megatron's gradient buffers and checkpoints
keep them), its tp_group, and return Megatron's `(output, output_bias)` pair: with skip_bias_add the bias is
returned, not added. Layers in another configuration are left alone and listed in the report with the reason.
Megatron is not imported here: its classes are looked up among the modules the model was built from.
"""
import sys
from typing import List, Optional, Tuple

import torch
from torch import nn

from .._groups import GroupInfo, resolve_group
from .._ops import allgather_gemm, gemm_allreduce, gemm_reduce_scatter
from .column_parallel_linear import ColumnParallelLinear
from .conversion import ReplaceReport, modules_by_id, put_in_place, reported
from .reduced_input_grad import linear_with_reduced_input_grad
from .row_parallel_linear import RowParallelLinear, check_algorithm

WHO = "replace_megatron"
_LAYERS_MODULE = "megatron.core.tensor_parallel.layers"


class MegatronRowParallelLinear(RowParallelLinear):
    """What a Megatron-core RowParallelLinear becomes: `(all_reduce(x @ weight.T) + bias, None)`, or with
    skip_bias_add `(all_reduce(x @ weight.T), bias)`, the reduction fused with the GEMM (with sequence parallelism a
    reduce-scatter along dim 0, the bias added to this rank's chunk)."""

    skip_bias_add = False

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if x.dim() not in (2, 3) or x.shape[-1] != self.in_features_per_rank:
            raise ValueError(f"MegatronRowParallelLinear: the input must be 2-D or 3-D with this rank's shard of the "
                             f"hidden dimension ({self.in_features_per_rank}) last; got shape {tuple(x.shape)}")
        bias = None if self.skip_bias_add else self.bias
        if self.sequence_parallel:
            out = gemm_reduce_scatter(x, self.weight.t(), self.group_name, scatter_dim=0, bias=bias,
                                      algorithm=self.algorithm)
        else:
            out = gemm_allreduce(x, self.weight.t(), self.group_name, bias=bias, algorithm=self.algorithm)
        return out, (self.bias if self.skip_bias_add else None)


class MegatronColumnParallelLinear(ColumnParallelLinear):
    """What a Megatron-core ColumnParallelLinear (gather_output=False) becomes: `(x @ weight.T + bias, None)`, or
    with skip_bias_add `(x @ weight.T, bias)`; backward all-reduces the input gradient fused with its GEMM. With
    sequence parallelism `x` is this rank's chunk of the sequence (dim 0), all-gathered fused with the GEMM."""

    skip_bias_add = False

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if weight is not None or runtime_gather_output:
            raise ValueError("MegatronColumnParallelLinear: a weight passed to forward or runtime_gather_output=True "
                             "is not supported (the layer was converted without them)")
        if x.dim() == 0 or x.shape[-1] != self.in_features or (self.sequence_parallel and x.dim() not in (2, 3)):
            raise ValueError(f"MegatronColumnParallelLinear: the input must be [*, in_features={self.in_features}] "
                             f"(2-D or 3-D with sequence parallelism); got shape {tuple(x.shape)}")
        bias = None if self.skip_bias_add else self.bias
        if self.sequence_parallel:
            out = allgather_gemm(x, self.weight.t(), self.group_name, gather_dim=0, bias=bias, algorithm=self.algorithm)
        else:
            out = linear_with_reduced_input_grad(x, self.weight, bias, self.group_name, self.algorithm)
        return out, (self.bias if self.skip_bias_add else None)


def _common_problems(layer) -> List[str]:
    config = getattr(layer, "config", None)
    problems = []
    if getattr(layer, "explicit_expert_comm", False):
        problems.append("an expert layer whose communication the MoE dispatcher does")
    if getattr(layer, "gradient_accumulation_fusion", False):
        problems.append("gradient_accumulation_fusion (weight gradients accumulated into main_grad by a CUDA kernel)")
    if config is not None and getattr(config, "_cpu_offloading_context", None) is not None:
        problems.append("activation CPU offloading")
    if getattr(layer, "weight", None) is None:
        problems.append("no weight parameter of its own (skip_weight_param_allocation)")
    elif layer.weight.dim() != 2:
        problems.append(f"a {layer.weight.dim()}-D weight")
    if list(layer._forward_pre_hooks.values()) + list(layer._forward_hooks.values()):
        problems.append("forward hooks that a replacement would drop")
    return problems


def _row_problems(layer) -> List[str]:
    problems = _common_problems(layer)
    if not getattr(layer, "input_is_parallel", False):
        problems.append("input_is_parallel=False (it scatters its input itself)")
    return problems


def _column_problems(layer) -> List[str]:
    problems = _common_problems(layer)
    if getattr(layer, "gather_output", False):
        problems.append("gather_output=True (its output is all-gathered)")
    if getattr(layer, "disable_grad_reduce", False):
        problems.append("disable_grad_reduce=True (its input gradient is not all-reduced)")
    config = getattr(layer, "config", None)
    if config is not None and getattr(config, "defer_embedding_wgrad_compute", False):
        problems.append("defer_embedding_wgrad_compute")
    return problems


def _convert(cls, layer, info: GroupInfo, algorithm: str):
    new = cls._around(layer.weight, layer.bias, info, algorithm, sequence_parallel=bool(layer.sequence_parallel),
                      sequence_dim=0)
    new.skip_bias_add = bool(layer.skip_bias_add)
    new.train(layer.training)
    return new


def replace_megatron(model: nn.Module, *, algorithm: str = "auto") -> ReplaceReport:
    """Replace Megatron-core's RowParallelLinear and ColumnParallelLinear modules of `model` in place (found by type);
    returns the names replaced (a ReplaceReport whose `skipped` lists the layers left alone and why; also logged on
    the "torch_gemm_ar.nn" logger). Every rank of each layer's tp_group must call it on the same model."""
    check_algorithm(algorithm, WHO)
    layers = sys.modules.get(_LAYERS_MODULE)
    if layers is None:
        return reported(ReplaceReport([], converter=WHO, ops="gemm_allreduce"))
    kinds = ((layers.RowParallelLinear, MegatronRowParallelLinear, _row_problems),
             (layers.ColumnParallelLinear, MegatronColumnParallelLinear, _column_problems))
    names_of, modules = modules_by_id(model)
    replaced, skipped = [], []
    for key, module in modules.items():
        for megatron_cls, cls, problems_of in kinds:
            if type(module) is not megatron_cls:  # a subclass may change forward: not converted
                if isinstance(module, megatron_cls):
                    skipped.append((names_of[key][0], f"a subclass {type(module).__name__} of {megatron_cls.__name__}"))
                continue
            problems = problems_of(module) + (["it is the model itself"] if "" in names_of[key] else [])
            if problems:
                skipped.append((names_of[key][0], "; ".join(problems)))
                continue
            info = resolve_group(module.tp_group, WHO)
            if info.world < 2:
                skipped.append((names_of[key][0], "a tensor-parallel group of one rank (nothing to fuse)"))
                continue
            put_in_place(model, names_of[key], _convert(cls, module, info, algorithm))
            replaced.append(names_of[key][0])
    return reported(ReplaceReport(replaced, skipped, converter=WHO, ops="gemm_allreduce"))


__all__ = ["MegatronColumnParallelLinear", "MegatronRowParallelLinear", "replace_megatron"]
