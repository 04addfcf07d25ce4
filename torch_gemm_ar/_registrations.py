"""Python-side registration of pto::gemm_allreduce: the fake (shape-only) kernel that torch.compile traces.
The CPU/NPU kernels and the autograd formula are registered in C++ (csrc/host)."""
import torch


@torch.library.register_fake("pto::gemm_allreduce")
def _gemm_allreduce_fake(a, b, group_name, *, bias=None, algorithm="auto"):
    torch._check(a.dim() in (2, 3), lambda: f"gemm_allreduce: a must be 2-D or 3-D; got {a.dim()}-D")
    torch._check(b.dim() == 2, lambda: f"gemm_allreduce: b must be 2-D [K, N]; got {b.dim()}-D")
    torch._check(a.shape[-1] == b.shape[0], lambda: "gemm_allreduce: a and b disagree on K")
    torch._check(
        a.device == b.device and (bias is None or bias.device == a.device),
        lambda: f"gemm_allreduce: a, b and bias must be on one device; got a on {a.device}, b on {b.device}"
        + ("" if bias is None else f", bias on {bias.device}"),
    )
    torch._check(a.dtype == b.dtype, lambda: f"gemm_allreduce: a and b must have the same dtype; got {a.dtype}, {b.dtype}")
    return a.new_empty((*a.shape[:-1], b.shape[1]))
