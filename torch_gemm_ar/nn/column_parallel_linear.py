"""ColumnParallelLinear with sequence parallelism: the all-gather of the sequence fused with the column-parallel GEMM."""
import math

import torch
from torch import nn

from .._ops import GroupLike, allgather_gemm
from ._groups import GroupInfo, resolve_group
from .row_parallel_linear import check_algorithm


class ColumnParallelLinear(nn.Module):
    """`y_local = all_gather(x_shard, sequence_dim) @ weight.T + bias` over a tensor-parallel group (allgather_gemm).

    Conventions of Megatron-LM's ColumnParallelLinear with `sequence_parallel=True, gather_output=False`:
    - the input is this rank's chunk of the sequence along `sequence_dim` (0 for [S, B, H] and [tokens, H], 1 for
      [B, S, H]), the full hidden dimension `in_features`; chunks have equal shapes on every rank;
    - `weight` is this rank's `[out_features // world, in_features]` row slice of the full weight, `bias` its
      `[out_features // world]` slice;
    - the output holds the whole sequence and this rank's `out_features // world` columns.
    Backward reduce-scatters the input gradient along `sequence_dim` (Megatron's gather_from_sequence_parallel_region).
    Only this configuration is implemented: sequence_parallel=False (which needs an all-reduce of the input
    gradient) and gather_output=True raise NotImplementedError.
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
        if not sequence_parallel:
            raise NotImplementedError(f"{who}: only sequence_parallel=True is implemented")
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
        self.sequence_dim = int(sequence_dim)
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
    def from_linear(cls, linear: nn.Linear, group: GroupLike = None, *, sequence_dim: int = 0,
                    algorithm: str = "auto") -> "ColumnParallelLinear":
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
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._set_group(info)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.sequence_dim = int(sequence_dim)
        layer.algorithm = check_algorithm(algorithm, "ColumnParallelLinear")
        with torch.no_grad():
            layer.weight = nn.Parameter(linear.weight[rows].clone(), requires_grad=linear.weight.requires_grad)
            if linear.bias is None:
                layer.register_parameter("bias", None)
            else:
                layer.bias = nn.Parameter(linear.bias[rows].clone(), requires_grad=linear.bias.requires_grad)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() not in (2, 3) or x.shape[-1] != self.in_features:
            raise ValueError(
                f"ColumnParallelLinear: the input must be this rank's 2-D or 3-D sequence chunk with last dim "
                f"in_features={self.in_features}; got shape {tuple(x.shape)}"
            )
        return allgather_gemm(x, self.weight.t(), self.group_name, gather_dim=self.sequence_dim, bias=self.bias,
                              algorithm=self.algorithm)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"world_size={self.world_size}, rank={self.rank}, sequence_parallel=True, gather_output=False, "
                f"sequence_dim={self.sequence_dim}, algorithm={self.algorithm!r}")


__all__ = ["ColumnParallelLinear"]
