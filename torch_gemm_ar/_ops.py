"""The Python entry points of the ops: the group resolved (naming the op in its errors), then torch.ops.pto.<op>."""
from typing import Optional, Tuple

import torch

from ._groups import GroupLike, group_name_of

ALGORITHMS = ("auto", "sequential", "chunked", "fused")


def gemm_allreduce(
    a: torch.Tensor,
    b: torch.Tensor,
    group: GroupLike = None,
    *,
    bias: Optional[torch.Tensor] = None,
    algorithm: str = "auto",
    a_scale: Optional[torch.Tensor] = None,
    b_scale: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """`all_reduce_sum(a @ b) + bias` over `group`, the same tensor on every rank.

    a: [M, K] or [B, S, K], this rank's shard. b: [K, N], any strides (weight.t() of an nn.Linear is not copied).
    bias: [N], added once to the reduced result. algorithm: one of auto, sequential, chunked, fused.

    Quantized (CPU; docs/usage.md, "Quantized inputs"): W8A8 takes int8 a and b, a_scale (float32, a's leading
    shape, per token, or one value) and b_scale (float32 [N] or one value) and returns
    `all_reduce_sum(a_scale * (a @ b in int32) * b_scale) + bias` in out_dtype (default bfloat16). W8A16 takes a
    float a, int8 b and b_scale: `all_reduce_sum(a @ (b * b_scale)) + bias` in a's dtype unless out_dtype says
    otherwise. Each rank's partial is dequantized to float32 and the sum is float32, rounded once to out_dtype; bias
    has out_dtype. Gradient: with respect to W8A16's a only.
    """
    name = group_name_of(group, "gemm_allreduce")
    return torch.ops.pto.gemm_allreduce(
        a, b, name, bias=bias, algorithm=algorithm, a_scale=a_scale, b_scale=b_scale, out_dtype=out_dtype
    )


def gemm_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    group: GroupLike = None,
    *,
    scatter_dim: int = 0,
    bias: Optional[torch.Tensor] = None,
    algorithm: str = "auto",
) -> torch.Tensor:
    """`reduce_scatter_sum(a @ b)` along `scatter_dim` of the output (+ bias on every chunk): rank r gets chunk r.

    a: [M, K] or [B, S, K], this rank's K-shard (row-parallel). scatter_dim: a row dim of the output (not the last);
    its size must be divisible by the world size. algorithm: auto, sequential (matmul, then reduce_scatter_tensor) or
    fused (CPU engine: each rank reduces the tiles of its own output chunk while the GEMM runs; NPU: docs/ascend.md).
    Backward: an all-gather of the gradient (allgather_gemm).
    """
    return torch.ops.pto.gemm_reduce_scatter(
        a, b, group_name_of(group, "gemm_reduce_scatter"), scatter_dim=scatter_dim, bias=bias, algorithm=algorithm
    )


def allgather_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    group: GroupLike = None,
    *,
    gather_dim: int = 0,
    bias: Optional[torch.Tensor] = None,
    return_gathered: bool = False,
    algorithm: str = "auto",
):
    """`all_gather(a, gather_dim) @ b + bias`; with return_gathered=True, `(out, gathered_a)`.

    a: [M, K] or [B, S, K], this rank's sequence shard (equal shapes on every rank). gather_dim: a row dim of a (not
    K). algorithm: auto, sequential (all_gather_into_tensor, then matmul) or fused (CPU engine: the local rows are
    multiplied while the peers' shards are copied from shared memory; NPU: docs/ascend.md). Backward: a reduce-scatter of
    a's gradient (gemm_reduce_scatter); gathered_a is returned without gradient.
    """
    out, gathered = torch.ops.pto.allgather_gemm(
        a, b, group_name_of(group, "allgather_gemm"), gather_dim=gather_dim, bias=bias,
        return_gathered=return_gathered,
        algorithm=algorithm,
    )
    return (out, gathered) if return_gathered else out


def gemm_allreduce_add_rmsnorm(
    a: torch.Tensor,
    b: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    group: GroupLike = None,
    *,
    eps: float = 1e-6,
    bias: Optional[torch.Tensor] = None,
    algorithm: str = "auto",
    a_scale: Optional[torch.Tensor] = None,
    b_scale: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """gemm_allreduce followed by the residual add and the next RMSNorm of a transformer block: returns
    `(out, normed)` with `out = all_reduce_sum(a @ b) + bias + residual` (the new residual stream) and
    `normed = out * rsqrt(mean(out**2, -1) + eps) * norm_weight` (the next block's input), both the same on every
    rank. residual: a.shape[:-1] + [N]; norm_weight: [N]; both of a's dtype and device. The norm's statistics are
    computed in fp32 (fp64 for float64). Backward needs no communication, as for gemm_allreduce.
    a_scale, b_scale, out_dtype: quantized inputs (W8A8, W8A16), as for gemm_allreduce; residual and norm_weight then
    have the out dtype.
    """
    return torch.ops.pto.gemm_allreduce_add_rmsnorm(
        a, b, residual, norm_weight, group_name_of(group, "gemm_allreduce_add_rmsnorm"), eps=eps, bias=bias,
        algorithm=algorithm, a_scale=a_scale, b_scale=b_scale, out_dtype=out_dtype,
    )


def gemm_allreduce_add_rmsnorm_(
    a: torch.Tensor,
    b: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    group: GroupLike = None,
    *,
    eps: float = 1e-6,
    bias: Optional[torch.Tensor] = None,
    algorithm: str = "auto",
    a_scale: Optional[torch.Tensor] = None,
    b_scale: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """In-place gemm_allreduce_add_rmsnorm: writes the new residual stream `all_reduce_sum(a @ b) + bias + residual`
    into `residual` and returns `normed`. Bitwise the same results as the out-of-place op. On the CPU engine the
    reduced sum is added straight into `residual` while it is reduced and copied out, so no separate output is
    written and read back. `residual` must not overlap a, b, norm_weight or bias. Inference only: there is no
    backward (use gemm_allreduce_add_rmsnorm to train). a_scale, b_scale, out_dtype: as for
    gemm_allreduce_add_rmsnorm.
    """
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (a, b, residual, norm_weight, bias, a_scale, b_scale)
    ):
        raise RuntimeError(
            "gemm_allreduce_add_rmsnorm_: writes into residual and has no backward; an input requires grad "
            "(use gemm_allreduce_add_rmsnorm to train, or run under torch.no_grad() / torch.inference_mode())"
        )
    return torch.ops.pto.gemm_allreduce_add_rmsnorm_(
        a, b, residual, norm_weight, group_name_of(group, "gemm_allreduce_add_rmsnorm_"), eps=eps, bias=bias,
        algorithm=algorithm, a_scale=a_scale, b_scale=b_scale, out_dtype=out_dtype,
    )

