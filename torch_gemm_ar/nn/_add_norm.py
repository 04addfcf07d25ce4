"""The fused residual add + RMSNorm after a row-parallel layer's reduction, shared by RowParallelLinear and
DTensorRowParallelLinear: argument checks, nn.RMSNorm's eps default, and inputs of any rank around the 2-D/3-D op."""
from typing import Optional, Tuple

import torch
from torch import nn

from .._ops import gemm_allreduce_add_rmsnorm


def check_norm(layer: str, norm: Optional[nn.Module], residual: Optional[torch.Tensor], out_features: int) -> None:
    if residual is None or norm is None:
        raise ValueError(f"{layer}: residual and norm must be given together (forward(x, residual, norm))")
    if not isinstance(norm, nn.RMSNorm) or norm.weight is None or tuple(norm.normalized_shape) != (out_features,):
        raise ValueError(f"{layer}: norm must be an nn.RMSNorm({out_features}) with elementwise_affine=True; "
                         f"got {norm!r}")


def add_rmsnorm_after_reduction(x_local: torch.Tensor, weight_t: torch.Tensor, bias: Optional[torch.Tensor],
                                residual: torch.Tensor, norm: nn.Module, group_name: str, algorithm: str,
                                out_features: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """`(out, normed)` with out = all_reduce_sum(x_local @ weight_t) + bias + residual and normed = norm(out)."""
    norm_weight = norm.weight.to_local() if hasattr(norm.weight, "to_local") else norm.weight
    eps = norm.eps if norm.eps is not None else torch.finfo(x_local.dtype).eps  # nn.RMSNorm's default
    flat = x_local.dim() not in (2, 3)
    xs = x_local.reshape(-1, x_local.shape[-1]) if flat else x_local
    res = residual.reshape(-1, residual.shape[-1]) if flat and residual.dim() == x_local.dim() else residual
    out, normed = gemm_allreduce_add_rmsnorm(xs, weight_t, res, norm_weight, group_name, eps=eps, bias=bias,
                                             algorithm=algorithm)
    if flat:
        shape = (*x_local.shape[:-1], out_features)
        out, normed = out.reshape(shape), normed.reshape(shape)
    return out, normed
