"""Python-side registration of pto::gemm_allreduce: the fake (shape-only) kernel that torch.compile traces.
The CPU/NPU kernels and the autograd formula are registered in C++ (csrc/host)."""
import torch


_QUANT_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _quantized_out_dtype(a, b, a_scale, b_scale, out_dtype):
    """The out dtype of a quantized call (the checks of common/quantization.cpp that decide it), or None for a
    plain call."""
    if a.dtype != torch.int8 and b.dtype != torch.int8 and a_scale is None and b_scale is None and (
        out_dtype is None or out_dtype == a.dtype
    ):
        return None
    torch._check(b.dtype == torch.int8, lambda: f"gemm_allreduce: quantized calls take an int8 b; got b {b.dtype}")
    torch._check(b_scale is not None, lambda: "gemm_allreduce: b is int8, so b_scale is required")
    if a.dtype == torch.int8:
        torch._check(a_scale is not None, lambda: "gemm_allreduce: a is int8, so a_scale is required")
        out = torch.bfloat16 if out_dtype is None else out_dtype
    else:
        torch._check(a.dtype in _QUANT_OUT_DTYPES, lambda: f"gemm_allreduce: W8A16 takes a float a; got {a.dtype}")
        torch._check(a_scale is None, lambda: "gemm_allreduce: a_scale is only for int8 a (W8A8)")
        out = a.dtype if out_dtype is None else out_dtype
    torch._check(out in _QUANT_OUT_DTYPES, lambda: f"gemm_allreduce: out_dtype must be float32, bfloat16 or "
                                                   f"float16; got {out}")
    return out


@torch.library.register_fake("pto::gemm_allreduce")
def _gemm_allreduce_fake(a, b, group_name, *, bias=None, algorithm="auto", a_scale=None, b_scale=None,
                         out_dtype=None):
    torch._check(a.dim() in (2, 3), lambda: f"gemm_allreduce: a must be 2-D or 3-D; got {a.dim()}-D")
    torch._check(b.dim() == 2, lambda: f"gemm_allreduce: b must be 2-D [K, N]; got {b.dim()}-D")
    torch._check(a.shape[-1] == b.shape[0], lambda: "gemm_allreduce: a and b disagree on K")
    torch._check(
        a.device == b.device and (bias is None or bias.device == a.device),
        lambda: f"gemm_allreduce: a, b and bias must be on one device; got a on {a.device}, b on {b.device}"
        + ("" if bias is None else f", bias on {bias.device}"),
    )
    quantized_out = _quantized_out_dtype(a, b, a_scale, b_scale, out_dtype)
    if quantized_out is not None:
        return a.new_empty((*a.shape[:-1], b.shape[1]), dtype=quantized_out)
    torch._check(a.dtype == b.dtype, lambda: f"gemm_allreduce: a and b must have the same dtype; got {a.dtype}, {b.dtype}")
    return a.new_empty((*a.shape[:-1], b.shape[1]))


def _group_size(group_name):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()


def _row_dim(op, arg, dim, a):
    torch._check(
        -a.dim() <= dim < a.dim() - 1,
        lambda: f"{op}: {arg}={dim} must name a row dim of a {a.dim()}-D input; the last dim cannot be sharded",
    )
    return dim % a.dim()


@torch.library.register_fake("pto::gemm_reduce_scatter")
def _gemm_reduce_scatter_fake(a, b, group_name, *, scatter_dim=0, bias=None, algorithm="auto"):
    out = _gemm_allreduce_fake(a, b, group_name, bias=bias, algorithm=algorithm)
    dim, world = _row_dim("gemm_reduce_scatter", "scatter_dim", scatter_dim, a), _group_size(group_name)
    torch._check(
        out.shape[dim] % world == 0,
        lambda: f"gemm_reduce_scatter: the output's size along scatter_dim={scatter_dim} is {out.shape[dim]}, "
        f"not divisible by the world size {world}",
    )
    shape = list(out.shape)
    shape[dim] //= world
    return a.new_empty(shape)


@torch.library.register_fake("pto::allgather_gemm")
def _allgather_gemm_fake(a, b, group_name, *, gather_dim=0, bias=None, return_gathered=False, algorithm="auto"):
    _gemm_allreduce_fake(a, b, group_name, bias=bias, algorithm=algorithm)
    dim, world = _row_dim("allgather_gemm", "gather_dim", gather_dim, a), _group_size(group_name)
    gathered_shape = list(a.shape)
    gathered_shape[dim] *= world
    out = a.new_empty((*gathered_shape[:-1], b.shape[1]))
    return out, (a.new_empty(gathered_shape) if return_gathered else None)


@torch.library.register_fake("pto::gemm_allreduce_add_rmsnorm")
def _gemm_allreduce_add_rmsnorm_fake(a, b, residual, norm_weight, group_name, *, eps=1e-6, bias=None,
                                     algorithm="auto", a_scale=None, b_scale=None, out_dtype=None):
    out = _gemm_allreduce_fake(a, b, group_name, bias=bias, algorithm=algorithm, a_scale=a_scale, b_scale=b_scale,
                               out_dtype=out_dtype)
    torch._check(
        tuple(residual.shape) == tuple(out.shape),
        lambda: f"gemm_allreduce_add_rmsnorm: residual must have shape {tuple(out.shape)}; got {tuple(residual.shape)}",
    )
    torch._check(
        norm_weight.dim() == 1 and norm_weight.shape[0] == b.shape[1],
        lambda: f"gemm_allreduce_add_rmsnorm: norm_weight must be 1-D [{b.shape[1]}]; got {tuple(norm_weight.shape)}",
    )
    torch._check(
        residual.device == a.device and norm_weight.device == a.device,
        lambda: f"gemm_allreduce_add_rmsnorm: residual and norm_weight must be on the device of a ({a.device}); "
        f"got residual on {residual.device}, norm_weight on {norm_weight.device}",
    )
    torch._check(
        residual.dtype == out.dtype and norm_weight.dtype == out.dtype,
        lambda: "gemm_allreduce_add_rmsnorm: residual and norm_weight must have the dtype of the result",
    )
    return out, out.new_empty(out.shape)


@torch.library.register_fake("pto::gemm_allreduce_add_rmsnorm_")
def _gemm_allreduce_add_rmsnorm_inplace_fake(a, b, residual, norm_weight, group_name, *, eps=1e-6, bias=None,
                                             algorithm="auto", a_scale=None, b_scale=None, out_dtype=None):
    out, normed = _gemm_allreduce_add_rmsnorm_fake(a, b, residual, norm_weight, group_name, eps=eps, bias=bias,
                                                   algorithm=algorithm, a_scale=a_scale, b_scale=b_scale,
                                                   out_dtype=out_dtype)
    return normed

