"""RowParallelLinear: the row-parallel layer of Megatron-LM / vLLM with its GEMM and AllReduce fused."""
import math
from typing import Optional

import torch
from torch import nn

from .._ops import ALGORITHMS, GroupLike, gemm_allreduce, gemm_reduce_scatter
from ._add_norm import add_rmsnorm_after_reduction, check_norm
from .._groups import GroupInfo, resolve_group


def check_algorithm(algorithm: str, who: str) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{who}: algorithm must be one of {', '.join(ALGORITHMS)}; got {algorithm!r}")
    return algorithm


class RowParallelLinear(nn.Module):
    """`y = all_reduce_sum(x_local @ weight.T) + bias` over a tensor-parallel group, as one fused op.

    Conventions of Megatron-LM's and vLLM's RowParallelLinear:
    - the input is this rank's shard of the hidden dimension: `[..., in_features // world]`;
    - `weight` is this rank's `[out_features, in_features // world]` column slice of the full weight;
    - `bias` is the full `[out_features]` vector, added once after the reduction (not once per rank);
    - the output `[..., out_features]` is the same on every rank of the group.
    Parameter names and shapes are those of a plain sharded `nn.Linear`, so state_dicts move between the two.
    Unlike Megatron/vLLM, `forward` returns the tensor only (no `(output, output_bias)` pair), like `nn.Linear`.
    Backward needs no communication: the output gradient is replicated, so every gradient is a local product.

    With `sequence_parallel=True` (Megatron-LM's sequence parallelism) the AllReduce becomes a ReduceScatter along
    `sequence_dim` of the output (gemm_reduce_scatter): rank r gets the r-th chunk of the sequence, with the bias
    added to it; the input still holds the whole sequence. `sequence_dim` is 0 for Megatron's [S, B, H] and
    [tokens, H] layouts, 1 for [B, S, H]; its size must be divisible by the world size. The backward all-gathers the
    output gradient.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: GroupLike = None,
        algorithm: str = "auto",
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        info = resolve_group(group, "RowParallelLinear")
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"RowParallelLinear: in_features and out_features must be positive; got {in_features}, "
                             f"{out_features}")
        if in_features % info.world:
            raise ValueError(
                f"RowParallelLinear: in_features={in_features} is not divisible by the group's world size "
                f"{info.world}; every rank must hold an equal shard of the input dimension"
            )
        self._set_group(info)
        self.in_features = in_features
        self.out_features = out_features
        self.algorithm = check_algorithm(algorithm, "RowParallelLinear")
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), int(sequence_dim)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features_per_rank, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def _set_group(self, info: GroupInfo) -> None:
        # Only the name is kept for forward: a str is what the op takes and what torch.compile treats as a constant.
        self.group_name = info.name
        self.world_size = info.world
        self.rank = info.rank

    @property
    def in_features_per_rank(self) -> int:
        return self.in_features // self.world_size

    def reset_parameters(self) -> None:
        """The weight is this rank's slice of a full `[out, in]` weight drawn exactly as nn.Linear draws it, from the
        global RNG: with the same seed on every rank it equals `from_linear(nn.Linear(in, out))` under that seed,
        whatever the world size, and the shards are never copies of each other (a per-shard draw would repeat
        one block on every rank). The full weight exists only during this call. The bias starts at zero, as in
        Megatron-LM: a random bias could differ between ranks, and the op adds each rank's own bias."""
        if self.weight.device.type != "meta":
            full = torch.empty(self.out_features, self.in_features, dtype=self.weight.dtype, device=self.weight.device)
            nn.init.kaiming_uniform_(full, a=math.sqrt(5))  # nn.Linear.reset_parameters' weight draw
            width = self.in_features_per_rank
            with torch.no_grad():
                self.weight.copy_(full[:, self.rank * width:(self.rank + 1) * width])
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: GroupLike = None, *, algorithm: str = "auto",
                    sequence_parallel: bool = False, sequence_dim: int = 0) -> "RowParallelLinear":
        """Shard a full (unsharded) `nn.Linear`: keep this rank's slice of its input dimension.

        The rank's slice is columns `[r * in/world, (r+1) * in/world)` of `linear.weight` with r its rank in `group`;
        the bias is kept whole. The copies are new tensors (same dtype, device and requires_grad), so the full
        layer can be freed. `from_linear(linear).state_dict()` equals the state_dict of an `nn.Linear(in/world,
        out)` holding the same slice.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"RowParallelLinear.from_linear: expected an nn.Linear; got {type(linear).__name__}")
        info = resolve_group(group, "RowParallelLinear.from_linear")
        if linear.in_features % info.world:
            raise ValueError(
                f"RowParallelLinear.from_linear: in_features={linear.in_features} is not divisible by the group's "
                f"world size {info.world}; every rank must hold an equal shard of the input dimension"
            )
        width = linear.in_features // info.world
        with torch.no_grad():
            weight = linear.weight[:, info.rank * width:(info.rank + 1) * width].clone(
                memory_format=torch.contiguous_format)
            bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls._around(
            nn.Parameter(weight, requires_grad=linear.weight.requires_grad),
            None if bias is None else nn.Parameter(bias, requires_grad=linear.bias.requires_grad),
            info,
            algorithm,
            sequence_parallel=sequence_parallel,
            sequence_dim=sequence_dim,
        )

    @classmethod
    def _around(cls, weight: nn.Parameter, bias: Optional[nn.Parameter], info: GroupInfo,
                algorithm: str, *, sequence_parallel: bool = False, sequence_dim: int = 0) -> "RowParallelLinear":
        """A layer that adopts existing Parameter objects (the shard `[out, in/world]` and the full bias): optimizers
        and gradient hooks that hold them keep working."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._set_group(info)
        layer.out_features, width = weight.shape
        layer.in_features = width * info.world
        layer.algorithm = check_algorithm(algorithm, "RowParallelLinear")
        layer.sequence_parallel, layer.sequence_dim = bool(sequence_parallel), int(sequence_dim)
        layer.weight = weight
        if bias is None:
            layer.register_parameter("bias", None)
        else:
            layer.bias = bias
            if layer.sequence_parallel:
                bias.sequence_parallel = True  # its gradient is this rank's share (see the class docstring)
        return layer

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, norm: Optional[nn.Module] = None):
        """`forward(x)`: the layer's output. `forward(x, residual, norm)` with `norm` an `nn.RMSNorm` over
        `out_features`: the transformer block's residual add and next RMSNorm fused after the reduction, returning
        `(out, normed)` with `out = layer(x) + residual` and `normed = norm(out)` (gemm_allreduce_add_rmsnorm)."""
        if residual is not None or norm is not None:
            return self._forward_add_norm(x, residual, norm)
        if x.shape[-1] != self.in_features_per_rank:
            raise ValueError(
                f"RowParallelLinear: the input must be this rank's shard of the hidden dimension, last dim "
                f"in_features // world = {self.in_features} // {self.world_size} = {self.in_features_per_rank}; "
                f"got shape {tuple(x.shape)}"
            )
        weight_t = self.weight.t()  # [in/world, out] view: the op reads nn.Linear's layout without a copy
        if self.sequence_parallel:
            if x.dim() not in (2, 3):
                raise ValueError(f"RowParallelLinear(sequence_parallel=True): the input must be 2-D or 3-D; got shape "
                                 f"{tuple(x.shape)}")
            return gemm_reduce_scatter(x, weight_t, self.group_name, scatter_dim=self.sequence_dim, bias=self.bias,
                                       algorithm=self.algorithm)
        if x.dim() in (2, 3):
            return gemm_allreduce(x, weight_t, self.group_name, bias=self.bias, algorithm=self.algorithm)
        # The op takes 2-D or 3-D; other ranks (1-D, 4-D+) are flattened around it as nn.Linear accepts them.
        flat = x.reshape(-1, x.shape[-1])
        out = gemm_allreduce(flat, weight_t, self.group_name, bias=self.bias, algorithm=self.algorithm)
        return out.reshape(*x.shape[:-1], self.out_features)

    @property
    def fuses_add_rmsnorm(self) -> bool:
        """True when forward(x, residual, norm) is available (it follows an all-reduce, not a reduce-scatter)."""
        return not self.sequence_parallel

    def _forward_add_norm(self, x, residual, norm):
        check_norm("RowParallelLinear", norm, residual, self.out_features)
        if self.sequence_parallel:
            raise ValueError("RowParallelLinear(sequence_parallel=True): forward(x, residual, norm) is not available; "
                             "the fused add+RMSNorm follows an all-reduce, not a reduce-scatter")
        if x.shape[-1] != self.in_features_per_rank:
            raise ValueError(
                f"RowParallelLinear: the input must be this rank's shard of the hidden dimension, last dim "
                f"{self.in_features_per_rank}; got shape {tuple(x.shape)}"
            )
        return add_rmsnorm_after_reduction(x, self.weight.t(), self.bias, residual, norm, self.group_name,
                                           self.algorithm, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"world_size={self.world_size}, rank={self.rank}, algorithm={self.algorithm!r}"
                + (f", sequence_parallel=True, sequence_dim={self.sequence_dim}" if self.sequence_parallel else ""))


__all__ = ["RowParallelLinear", "check_algorithm"]
