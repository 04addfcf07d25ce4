"""torch's async tensor parallel (Inductor's micro-pipeline TP) on this project's engine.

With `torch._inductor.config._micro_pipeline_tp = True` (torchtitan's async TP), Inductor rewrites an all-gather
feeding matmuls into `torch.ops.symm_mem.fused_all_gather_matmul` and a matmul feeding a reduce-scatter into
`torch.ops.symm_mem.fused_matmul_reduce_scatter`. torch 2.13 has CUDA and Meta kernels for them only, and its pass
returns early where torch is built without NCCL. `enable()` makes that path run on CPU ranks:

    torch_gemm_ar.async_tp.enable()
    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(group.group_name)      # torch's own switch for the pass, as torchtitan calls it

- CPU kernels for both ops: `fused_all_gather_matmul` runs `allgather_gemm` (one gather, the first product fused
  with it, the other products on the gathered input); `fused_matmul_reduce_scatter` runs `gemm_reduce_scatter`.
  A gather or scatter along the last dim (which the project's ops do not fuse) runs as the collective then matmul.
- A post-grad pass that runs torch's micro-pipeline pass where NCCL is absent, with the NCCL check answered true for
  the duration of that pass (the pass itself and every other check of it, the symmetric-memory switch above
  included, are torch's). docs/adoption.md says what this covers and what it does not.
"""
import threading
from typing import List, Optional, Tuple

import torch

_lock = threading.Lock()
_library = None  # the torch.library.Library holding the CPU kernels, once registered


def _row_dim(dim: int, t: torch.Tensor) -> Optional[int]:
    """`dim` normalised, or None when it is the last (K or N) dim, which the project's ops do not fuse."""
    dim = dim % t.dim()
    return None if dim == t.dim() - 1 else dim


def _gather_dim_outermost(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t` with the layout torch's reference kernel gives its outputs (the gathered dim outermost in memory): the op is
    tagged needs_fixed_stride_order, so Inductor checks the strides. One copy unless dim is 0."""
    return t if dim == 0 else t.movedim(dim, 0).contiguous().movedim(0, dim)


def _run_as(symm_op: str, pto_op: str, fn, *args, **kwargs):
    """fn(*args, **kwargs); an argument error (ValueError, TypeError) names the op the caller called as well as the
    one that ran it. The project's ops raise those on every rank of the group alike."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError) as e:
        raise ValueError(f"symm_mem.{symm_op} (run by torch_gemm_ar as pto.{pto_op}): {e}") from e


def _fused_all_gather_matmul_cpu(
    a_shard: torch.Tensor, bs: List[torch.Tensor], gather_dim: int, group_name: str, *, return_A: bool = True
) -> Tuple[Optional[torch.Tensor], List[torch.Tensor]]:
    from torch.distributed import _functional_collectives as funcol

    if not bs:
        raise ValueError("symm_mem.fused_all_gather_matmul: Bs is empty")
    # No local check of the operands before the collective: a rank that raised alone would leave its peers waiting.
    # On a row dim the project's op agrees on them first and raises on every rank; the last dim runs as torch's
    # reference kernel does (the collective, then the matmul).
    dim = _row_dim(gather_dim, a_shard)
    if dim is None:
        gathered = funcol.wait_tensor(funcol.all_gather_single(a_shard.contiguous(), gather_dim, group_name))
        return (gathered if return_A else None), [torch.matmul(gathered, b) for b in bs]
    need_gathered = return_A or len(bs) > 1
    first, gathered = _run_as("fused_all_gather_matmul", "allgather_gemm", torch.ops.pto.allgather_gemm, a_shard,
                              bs[0], group_name, gather_dim=dim, return_gathered=need_gathered)
    outs = [first] + [torch.matmul(gathered, b) for b in bs[1:]]
    outs = [_gather_dim_outermost(out, dim) for out in outs]
    return (_gather_dim_outermost(gathered, dim) if return_A else None), outs


def _fused_matmul_reduce_scatter_cpu(
    a: torch.Tensor, b: torch.Tensor, reduce_op: str, scatter_dim: int, group_name: str
) -> torch.Tensor:
    from torch.distributed import _functional_collectives as funcol

    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"symm_mem.fused_matmul_reduce_scatter: reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    dim = _row_dim(scatter_dim, a)
    if dim is None:
        return funcol.wait_tensor(funcol.reduce_scatter_single(torch.matmul(a, b), reduce_op, scatter_dim,
                                                               group_name))
    out = _run_as("fused_matmul_reduce_scatter", "gemm_reduce_scatter", torch.ops.pto.gemm_reduce_scatter, a, b,
                  group_name, scatter_dim=dim)
    if reduce_op == "avg":
        out = out / torch.distributed.distributed_c10d._get_group_size_by_name(group_name)
    return out


def register_kernels() -> None:
    """Register the CPU kernels of symm_mem's fused ops (idempotent; they stay for the process)."""
    global _library
    import torch.distributed._symmetric_memory  # noqa: F401  (defines the symm_mem ops)

    with _lock:
        if _library is not None:
            return
        library = torch.library.Library("symm_mem", "IMPL")
        library.impl("fused_all_gather_matmul", _fused_all_gather_matmul_cpu, "CPU")
        library.impl("fused_matmul_reduce_scatter", _fused_matmul_reduce_scatter_cpu, "CPU")
        _library = library


def _pass_base():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


class MicroPipelineTPWithoutNccl(_pass_base()):
    """Inductor post-grad custom pass: where torch has no NCCL, torch's micro-pipeline TP pass, run when
    `_micro_pipeline_tp` is on; then the pass that was installed before it (if any)."""

    _gate_lock = threading.Lock()

    def __init__(self, previous=None):
        self.previous = previous

    def __call__(self, graph: torch.fx.Graph) -> None:
        import torch._inductor.config as inductor_config

        if inductor_config._micro_pipeline_tp and not torch.distributed.is_nccl_available():
            from torch._inductor.fx_passes.micro_pipeline_tp import micro_pipeline_tp_pass

            # The pass asks torch.distributed.is_nccl_available() before each fusion; the kernels above need no
            # NCCL. Answered true only while the pass runs, one compilation at a time, and only to the thread running
            # it: any other thread asking meanwhile gets torch's own answer.
            with self._gate_lock:
                original = torch.distributed.is_nccl_available
                compiling = threading.get_ident()

                def is_nccl_available() -> bool:
                    return threading.get_ident() == compiling or original()

                torch.distributed.is_nccl_available = is_nccl_available
                try:
                    micro_pipeline_tp_pass(graph)
                finally:
                    torch.distributed.is_nccl_available = original
        if self.previous is not None:
            self.previous(graph)

    def uuid(self):
        from torch._inductor.custom_graph_pass import get_hash_for_files

        if self.previous is not None and not hasattr(self.previous, "uuid"):
            return None  # a chained pass without a uuid: no cache key, so Inductor bypasses its FX graph cache
        previous = None if self.previous is None else self.previous.uuid()
        return (get_hash_for_files((__file__,)), previous)


def enable() -> None:
    """Register the CPU kernels and install the pass as Inductor's post_grad_custom_post_pass (chained in front of
    one already there). Idempotent; disable() removes the pass (the kernels stay)."""
    import torch._inductor.config as inductor_config

    register_kernels()
    with _lock:
        current = inductor_config.post_grad_custom_post_pass
        if _find(current):
            return
        inductor_config.post_grad_custom_post_pass = MicroPipelineTPWithoutNccl(current)


def _find(custom_pass) -> bool:
    """Whether the pass chain starting at `custom_pass` already holds this module's pass."""
    while custom_pass is not None:
        if isinstance(custom_pass, MicroPipelineTPWithoutNccl):
            return True
        custom_pass = getattr(custom_pass, "previous", None)
    return False


def disable() -> None:
    """Take this module's pass out of Inductor's post-grad pass chain, where enable() put it, also when another pass
    was chained in front of it since (found through that pass's `previous`). Graphs compiled meanwhile keep their
    fused ops. A pass installed later that wraps it without exposing `previous` keeps it: is_enabled() says so."""
    import torch._inductor.config as inductor_config

    with _lock:
        current = inductor_config.post_grad_custom_post_pass
        if isinstance(current, MicroPipelineTPWithoutNccl):
            inductor_config.post_grad_custom_post_pass = current.previous
            return
        node = current
        while node is not None:
            following = getattr(node, "previous", None)
            if isinstance(following, MicroPipelineTPWithoutNccl):
                node.previous = following.previous
                return
            node = following


def is_enabled() -> bool:
    import torch._inductor.config as inductor_config

    return _find(inductor_config.post_grad_custom_post_pass)


__all__ = ["MicroPipelineTPWithoutNccl", "disable", "enable", "is_enabled", "register_kernels"]
