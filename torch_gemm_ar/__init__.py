"""torch-gemm-ar: GEMM fused with the AllReduce that follows it (tensor-parallel row-parallel layers).

`gemm_allreduce(a, b, group)` returns `all_reduce_sum(a_rank @ b) [+ bias]`, identical on every rank; it is also
available as `torch.ops.pto.gemm_allreduce(a, b, group_name, *, bias=None, algorithm="auto")`.
Sequence parallelism: `gemm_reduce_scatter` (GEMM + ReduceScatter) and `allgather_gemm` (AllGather + GEMM).
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers torch.ops.pto.gemm_allreduce)
from . import _registrations  # noqa: F401  (fake kernel and autograd formula)
from .errors import check_errors, register_error_checker

if hasattr(torch, "npu"):  # torch_npu is loaded: register the Ascend kernel too (built only where CANN was found)
    try:
        from . import _C_npu  # noqa: F401
    except ImportError as _error:
        import warnings

        warnings.warn(f"torch-gemm-ar: the Ascend NPU backend is not built ({_error}); see docs/ascend.md")
    else:
        register_error_checker(_C_npu.check_errors)
from ._ops import (
    ALGORITHMS, allgather_gemm, gemm_allreduce, gemm_allreduce_add_rmsnorm, gemm_allreduce_add_rmsnorm_,
    gemm_reduce_scatter, group_name_of,
)
from . import engine_options, nn, tuning
from .tuning import tune

__all__ = [
    "ALGORITHMS", "allgather_gemm", "check_errors", "engine_options", "gemm_allreduce",
    "gemm_allreduce_add_rmsnorm", "gemm_allreduce_add_rmsnorm_", "gemm_reduce_scatter", "group_name_of", "nn", "tune", "tuning",
]
__version__ = "0.1.0"


def __getattr__(name):
    # torch_gemm_ar.compile (the torch.compile rewrite) and .async_tp (torch's async-TP ops on the engine) import
    # Inductor pieces: loaded on first use only.
    if name in ("compile", "async_tp"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
