"""The column-parallel linear layer without sequence parallelism: a local GEMM forward, and in backward the input
gradient's all-reduce fused with the GEMM that produces it (gemm_allreduce).

Megatron-LM's ColumnParallelLinear(sequence_parallel=False) enters the tensor-parallel region with an identity whose
backward all-reduces the input gradient: each rank holds `grad_out_r @ weight_r` for its own output columns, and the
input's gradient is their sum. That is a row-parallel GEMM + AllReduce in backward (K = this rank's out/world), and
a training step runs one per column-parallel layer (q, k, v, gate, up in a Llama block).
"""
from typing import Optional

import torch
import torch.nn.functional as F

from .._ops import gemm_allreduce


class _LinearWithReducedInputGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group_name: str, algorithm: str):
        device = x.device.type
        if torch.is_autocast_enabled(device):
            # What autocast makes of F.linear, done by hand so that backward multiplies the same dtype: the incoming
            # gradient has it, and gemm_allreduce takes one dtype (autograd casts the returned gradients back).
            dtype = torch.get_autocast_dtype(device)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        # Only what backward uses: x for the weight's gradient, the weight for the input's.
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None)
        ctx.group_name, ctx.algorithm, ctx.has_bias = group_name, algorithm, bias is not None
        ctx.x_shape = x.shape
        with torch.autocast(device, enabled=False):
            return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad2d = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_weight = grad_bias = None
        # Every rank of the group must need the input's gradient alike (SPMD): the all-reduce is collective.
        if ctx.needs_input_grad[0]:
            grad_x = gemm_allreduce(grad2d, weight, ctx.group_name, algorithm=ctx.algorithm).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            # [out/world, in] like the weight itself, so AccumulateGrad adopts it without a copy.
            grad_weight = grad2d.t().matmul(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad2d.sum(0)
        return grad_x, grad_weight, grad_bias, None, None


def linear_with_reduced_input_grad(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                   group_name: str, algorithm: str) -> torch.Tensor:
    """`F.linear(x, weight, bias)` on this rank's `[out/world, in]` weight shard and the replicated input `x`; its
    backward returns `all_reduce_sum(grad @ weight)` over the group as x's gradient, in one fused gemm_allreduce."""
    return _LinearWithReducedInputGrad.apply(x, weight, bias, group_name, algorithm)


__all__ = ["linear_with_reduced_input_grad"]
