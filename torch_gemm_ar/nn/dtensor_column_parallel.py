"""Taking over an nn.Linear that torch.distributed.tensor.parallel.ColwiseParallel parallelized:
- input_layouts=Shard(d): sequence parallelism's all-gather of the sequence followed by the column-parallel GEMM
  (allgather_gemm; replace_sequence_parallel);
- input_layouts=Replicate() (the default): a local GEMM whose backward all-reduces the input gradient (DTensor's
  Partial -> Replicate), fused with the GEMM that produces it (gemm_allreduce; replace_column_parallel).

ColwiseParallel installs the same two hooks as RowwiseParallel (read by read_style_hooks): the pre-hook turns the
input into a DTensor with `input_layouts` and redistributes it to Replicate (the all-gather), the hook turns the
Shard(-1) output into `output_layouts` and, with use_local_output, its local tensor. weight and bias are Shard(0).
"""
from typing import List, Optional, Tuple

import torch
from torch import nn

from .._ops import allgather_gemm
from .dtensor_row_parallel import (
    RowwiseLayouts, adopt_parallelized_linear, is_dtensor, parallelized_linear_repr, read_style_hooks,
    sequence_shard_dim, transformers_layouts,
)
from .reduced_input_grad import linear_with_reduced_input_grad


def read_colwise_style(module: nn.Module) -> Tuple[Optional[RowwiseLayouts], List[str], bool]:
    """(layouts, other_hooks, found) of a column-parallel style on `module`: torch's ColwiseParallel hooks, or
    transformers' ColwiseParallel forward (tp_plan "colwise", "colwise_rep", ...); `found` says whether either is
    there, `other_hooks` what a replacement would drop."""
    layouts, others, found = read_style_hooks(module, "ColwiseParallel")
    if not found:
        layouts = transformers_layouts(module, others, "ColwiseParallel")
        found = layouts is not None
    return layouts, others, found


def colwise_problems(module: nn.Module, layouts: Optional[RowwiseLayouts], other_hooks: List[str],
                     group_name: Optional[str] = None, *, replicated_input: bool = False) -> List[str]:
    """Why `module` cannot be replaced by a DTensorColumnParallelLinear (empty list: it can): with its input sharded
    on a sequence dim (an all-gather to fuse), or with `replicated_input` its input Replicate (a backward all-reduce
    to fuse)."""
    from torch.distributed.tensor import Replicate, Shard

    fused = "a GEMM whose backward all-reduces" if replicated_input else "an all-gather + GEMM"
    if not isinstance(module, nn.Linear):
        kind = type(module).__name__
        return [f"it is a {kind}, not an nn.Linear (ColwiseParallel on {kind} is not {fused})"]
    weight, bias = module.weight, module.bias
    if not is_dtensor(weight) or weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        placements = tuple(weight.placements) if is_dtensor(weight) else "a plain tensor"
        return [f"its weight is {placements}, not Shard(0) on a 1-D mesh: not column-parallel"]
    if layouts is None:
        return ["ColwiseParallel's hooks are not on it, so its input and output handling is unknown"]
    problems = []
    if other_hooks:
        problems.append("it has other hooks that a replacement would drop: " + ", ".join(other_hooks))
    if replicated_input and tuple(layouts.input_layouts) != (Replicate(),):
        what = ("sequence parallelism, which replace_sequence_parallel converts"
                if sequence_shard_dim(layouts.input_layouts) is not None else "no input-gradient all-reduce")
        problems.append(f"its input_layouts is {layouts.input_layouts}, not Replicate(): {what}")
    if not replicated_input and sequence_shard_dim(layouts.input_layouts) is None:
        problems.append(f"its input_layouts is {layouts.input_layouts}, not Shard(d) on a sequence (row) dim: no "
                        "all-gather to fuse")
    if tuple(layouts.output_layouts) != (Shard(-1),):
        problems.append(f"its output_layouts is {layouts.output_layouts}; only the column shard Shard(-1) is fused "
                        "(a gathered output is an all-gather after the GEMM)")
    if bias is not None and (not is_dtensor(bias) or tuple(bias.placements) != (Shard(0),)):
        problems.append("its bias is not a Shard(0) DTensor")
    world = layouts.mesh.size()
    if module.out_features % world:
        problems.append(f"out_features={module.out_features} is not divisible by the mesh size {world}: uneven "
                        "column shards")
    mesh_group = layouts.mesh.get_group()
    if group_name is not None and mesh_group.group_name != group_name:
        problems.append(f"it is sharded over the mesh's group {mesh_group.group_name!r}, but group= names "
                        f"{group_name!r}: wrong group")
    return problems


class DTensorColumnParallelLinear(nn.Module):
    """Stands in for an nn.Linear parallelized with ColwiseParallel: the same inputs (plain or DTensor), outputs
    (this rank's output columns) and Parameter objects (weight, bias: Shard(0) DTensors).
    - input_layouts=Shard(d): the input is this rank's sequence shard; the all-gather along d and the local GEMM run
      as one allgather_gemm on the mesh's group; backward reduce-scatters the input gradient, as DTensor's does.
    - input_layouts=Replicate(): the local GEMM; backward all-reduces the input gradient, as DTensor's does, in one
      gemm_allreduce with its GEMM (every rank must need the input's gradient alike).
    """

    def __init__(self, linear: nn.Linear, layouts: RowwiseLayouts, *, algorithm: str = "auto"):
        super().__init__()
        from torch.distributed.tensor import Replicate

        adopt_parallelized_linear(self, linear, layouts, algorithm)
        self.gather_dim = sequence_shard_dim(layouts.input_layouts)  # None: a replicated input
        if self.gather_dim is None and tuple(layouts.input_layouts) != (Replicate(),):
            raise ValueError(f"DTensorColumnParallelLinear: input_layouts={layouts.input_layouts}; expected "
                             "(Replicate(),) or (Shard(d),) on a sequence (row) dim")

    def _local_shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's sequence shard (or the replicated input): a plain input is taken as input_layouts says (as
        ColwiseParallel's pre-hook does); a DTensor input is redistributed to Shard(d) (Replicate) first if it is
        laid out otherwise."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if isinstance(x, DTensor):
            if self.gather_dim is None:
                if tuple(x.placements) != (Replicate(),):
                    x = x.redistribute(self.device_mesh, (Replicate(),))
                return x.to_local()
            dim = self.gather_dim + x.dim() if self.gather_dim < 0 else self.gather_dim
            if not (len(x.placements) == 1 and x.placements[0].is_shard(dim)):
                x = x.redistribute(self.device_mesh, (Shard(dim),))
            return x.to_local()
        return x

    def _output(self, out: torch.Tensor):
        if self.use_local_output:
            return out
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(out, self.device_mesh, self.output_layouts, run_check=False)

    def forward(self, x: torch.Tensor):
        local = self._local_shard(x)
        if self.gather_dim is None:
            weight = self.weight.to_local()  # [out/world, in]; its gradient comes back as a Shard(0) DTensor
            if local.dim() == 0 or local.shape[-1] != weight.shape[1]:
                raise ValueError(f"DTensorColumnParallelLinear: the input must be [*, {weight.shape[1]}]; got "
                                 f"{tuple(local.shape)}")
            bias = None if self.bias is None else self.bias.to_local()
            return self._output(linear_with_reduced_input_grad(local, weight, bias, self.group_name, self.algorithm))
        if local.dim() not in (2, 3):
            raise ValueError(f"DTensorColumnParallelLinear: the input must be 2-D or 3-D; got {tuple(local.shape)}")
        dim = self.gather_dim + local.dim() if self.gather_dim < 0 else self.gather_dim
        weight = self.weight.to_local()  # [out/world, in]; its gradient comes back as a Shard(0) DTensor
        if local.shape[-1] != weight.shape[1]:
            raise ValueError(f"DTensorColumnParallelLinear: the input has {local.shape[-1]} features, the weight "
                             f"{weight.shape[1]}; input shape {tuple(local.shape)}")
        bias = None if self.bias is None else self.bias.to_local()
        out = allgather_gemm(local, weight.t(), self.group_name, gather_dim=dim, bias=bias, algorithm=self.algorithm)
        return self._output(out)

    def extra_repr(self) -> str:
        return parallelized_linear_repr(self, with_output_layouts=False)
