"""ColumnParallelLinear: with sequence parallelism the all-gather of the sequence fused with the column-parallel GEMM;
without it, the input gradient's all-reduce fused with its GEMM in backward."""
import math
from typing import Optional

import torch
from torch import nn

from .._ops import GroupLike, allgather_gemm
from .._groups import GroupInfo, resolve_group
from .reduced_input_grad import linear_with_reduced_input_grad
from .row_parallel_linear import check_algorithm


class ColumnParallelLinear(nn.Module):
    """The column-parallel linear layer of Megatron-LM (`gather_output=False`) over a tensor-parallel group.

    - `weight` is this rank's `[out_features // world, in_features]` row slice of the full weight, `bias` its
      `[out_features // world]` slice; the output holds this rank's `out_features // world` columns.
    - `sequence_parallel=True` (the default): `y_local = all_gather(x_shard, sequence_dim) @ weight.T + bias`
      (allgather_gemm). The input is this rank's chunk of the sequence along `sequence_dim` (0 for [S, B, H] and
      [tokens, H], 1 for [B, S, H]), the full hidden dimension; chunks have equal shapes on every rank. Backward
      reduce-scatters the input gradient along `sequence_dim` (Megatron's gather_from_sequence_parallel_region).
    - `sequence_parallel=False`: the input `[*, in_features]` is replicated (the same on every rank), the forward
      is a local GEMM, and backward all-reduces the input gradient (Megatron's copy_to_tensor_model_parallel_region)
      fused with the GEMM that produces it (gemm_allreduce). Every rank must need the input's gradient alike.
    gather_output=True raises NotImplementedError.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: GroupLike = None,
        sequence_parallel: bool = True,
        gather_output: bool = False,
        sequence_dim: int = 0,
        algorithm: str = "auto",
        device=None,
        dtype=None,
    ):
        super().__init__()
        who = "ColumnParallelLinear"
        if gather_output:
            raise NotImplementedError(f"{who}: gather_output=True is not implemented (use gather_output=False)")
        info = resolve_group(group, who)
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"{who}: in_features and out_features must be positive; got {in_features}, {out_features}")
        if out_features % info.world:
            raise ValueError(
                f"{who}: out_features={out_features} is not divisible by the group's world size {info.world}; every "
                "rank must hold an equal shard of the output dimension"
            )
        self._set_group(info)
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), int(sequence_dim)
        self.algorithm = check_algorithm(algorithm, who)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self.out_features_per_rank, in_features, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features_per_rank, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def _set_group(self, info: GroupInfo) -> None:
        self.group_name, self.world_size, self.rank = info.name, info.world, info.rank

    @property
    def out_features_per_rank(self) -> int:
        return self.out_features // self.world_size

    def reset_parameters(self) -> None:
        """This rank's rows of a full weight drawn as nn.Linear draws it from the global RNG (same seed on every rank:
        the shards of one full weight); the bias starts at zero as in Megatron-LM."""
        if self.weight.device.type != "meta":
            full = torch.empty(self.out_features, self.in_features, dtype=self.weight.dtype, device=self.weight.device)
            nn.init.kaiming_uniform_(full, a=math.sqrt(5))
            rows = self.out_features_per_rank
            with torch.no_grad():
                self.weight.copy_(full[self.rank * rows:(self.rank + 1) * rows])
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: GroupLike = None, *, sequence_parallel: bool = True,
                    sequence_dim: int = 0, algorithm: str = "auto") -> "ColumnParallelLinear":
        """Shard a full `nn.Linear`: keep rows `[r * out/world, (r+1) * out/world)` of its weight and bias (copies)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"ColumnParallelLinear.from_linear: expected an nn.Linear; got {type(linear).__name__}")
        info = resolve_group(group, "ColumnParallelLinear.from_linear")
        if linear.out_features % info.world:
            raise ValueError(
                f"ColumnParallelLinear.from_linear: out_features={linear.out_features} is not divisible by the "
                f"group's world size {info.world}"
            )
        rows = slice(info.rank * (linear.out_features // info.world), (info.rank + 1) * (linear.out_features // info.world))
        with torch.no_grad():
            weight = nn.Parameter(linear.weight[rows].clone(), requires_grad=linear.weight.requires_grad)
            bias = None if linear.bias is None else nn.Parameter(linear.bias[rows].clone(),
                                                                 requires_grad=linear.bias.requires_grad)
        return cls._around(weight, bias, info, algorithm, sequence_parallel=sequence_parallel,
                           sequence_dim=sequence_dim)

    @classmethod
    def _around(cls, weight: nn.Parameter, bias: Optional[nn.Parameter], info: GroupInfo, algorithm: str, *,
                sequence_parallel: bool, sequence_dim: int = 0) -> "ColumnParallelLinear":
        """A layer that adopts existing Parameter objects (the shard `[out/world, in]` and the bias shard): optimizers
        and gradient hooks that hold them keep working."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._set_group(info)
        rows, layer.in_features = weight.shape
        layer.out_features = rows * info.world
        layer.sequence_parallel, layer.sequence_dim = bool(sequence_parallel), int(sequence_dim)
        layer.algorithm = check_algorithm(algorithm, "ColumnParallelLinear")
        layer.weight = weight
        if bias is None:
            layer.register_parameter("bias", None)
        else:
            layer.bias = bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            if x.dim() == 0 or x.shape[-1] != self.in_features:
                raise ValueError(f"ColumnParallelLinear: the input must be [*, in_features={self.in_features}] (the "
                                 f"same on every rank); got shape {tuple(x.shape)}")
            return linear_with_reduced_input_grad(x, self.weight, self.bias, self.group_name, self.algorithm)
        if x.dim() not in (2, 3) or x.shape[-1] != self.in_features:
            raise ValueError(
                f"ColumnParallelLinear: the input must be this rank's 2-D or 3-D sequence chunk with last dim "
                f"in_features={self.in_features}; got shape {tuple(x.shape)}"
            )
        return allgather_gemm(x, self.weight.t(), self.group_name, gather_dim=self.sequence_dim, bias=self.bias,
                              algorithm=self.algorithm)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"world_size={self.world_size}, rank={self.rank}, sequence_parallel={self.sequence_parallel}, "
                f"gather_output=False, sequence_dim={self.sequence_dim}, algorithm={self.algorithm!r}")


__all__ = ["ColumnParallelLinear"]
