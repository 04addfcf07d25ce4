"""`algorithm="auto"` by measurement: what the tuner decided, where it keeps its decisions, and `tune()` to decide
before serving or before graph capture.

The first calls of a group on a shape bucket (M rounded up to a power of two, K, N, dtype, bias, device, op) run
each candidate algorithm TORCH_GEMM_AR_AUTOTUNE_REPS times (default 3), round-robin; every call returns its correct
result. Each rank times its own calls and passes its time to the others inside the next call's signature, so no
extra collective runs and every rank takes the same decision: each run counts with its slowest rank's time, and the
candidate with the fastest run wins (load from elsewhere only adds time). Decisions are logged on the
`torch_gemm_ar.tuning` logger and kept in memory per group, and in a JSON file per host fingerprint (CPU
model, cores, library and torch versions): TORCH_GEMM_AR_TUNE_CACHE, by default
$XDG_CACHE_HOME/torch_gemm_ar/autotune.json (~/.cache/...). A cached decision is used when every rank of the group
has the same one. TORCH_GEMM_AR_AUTOTUNE=0 keeps the static policy (README, "auto").
"""
import logging
import os
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from . import _C
from ._ops import GroupLike, gemm_allreduce

logger = logging.getLogger("torch_gemm_ar.tuning")
_C._set_tuner_logger(logger.info)

# Candidates per bucket at most (fused, sequential, chunked): tune() makes enough calls for any bucket.
_MAX_CANDIDATES = 3


def decisions() -> List[dict]:
    """Every decision this process took: group, bucket, algorithm, source ("measured" or "cache") and, when
    measured, each candidate's fastest run (slowest rank's time) in microseconds."""
    return list(_C._tuner_decisions())


def cache_path() -> str:
    """The JSON file that keeps decisions across processes (TORCH_GEMM_AR_TUNE_CACHE or the default)."""
    return _C._tuner_cache_path()


def _reps() -> int:
    value = os.environ.get("TORCH_GEMM_AR_AUTOTUNE_REPS", "3")
    try:
        return max(1, int(value))
    except ValueError:
        raise ValueError(f"TORCH_GEMM_AR_AUTOTUNE_REPS must be an integer; got {value!r}") from None


def calls_to_decide() -> int:
    """How many calls on one shape bucket `auto` may spend tuning before it has decided: warm a model up with this
    many calls before timing it."""
    return _MAX_CANDIDATES * _reps() + 1


def tune(shapes: Iterable[Sequence[int]], group: GroupLike = None, dtype: torch.dtype = torch.float32, *,
         bias: bool = False, device: Optional[torch.device] = None) -> List[dict]:
    """Decides `auto` for each (M, K, N) on `group` now, with random inputs: M rows, this rank's K (the shard),
    N outputs, on `device` (default CPU; pass the rank's NPU to tune its calls there, timed by device events).
    Collective: every rank of the group calls it with the same arguments. Returns the decisions taken (none for
    buckets already decided in this process or with a single candidate)."""
    shapes = [tuple(int(v) for v in s) for s in shapes]
    for s in shapes:
        if len(s) != 3 or min(s) < 1:
            raise ValueError(f"tune: every shape must be (M, K, N) with positive sizes; got {s}")
    if os.environ.get("TORCH_GEMM_AR_AUTOTUNE", "1") == "0":
        raise RuntimeError("tune: TORCH_GEMM_AR_AUTOTUNE=0 disables measured auto (the static policy applies)")
    before = len(decisions())
    calls = calls_to_decide()  # every sample, then the deciding call; the same count on every rank
    generator = torch.Generator().manual_seed(0)
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=generator).to(device=device, dtype=dtype)
        b = torch.randn(k, n, generator=generator).to(device=device, dtype=dtype)
        bias_t = torch.randn(n, generator=generator).to(device=device, dtype=dtype) if bias else None
        for _ in range(calls):
            gemm_allreduce(a, b, group, bias=bias_t, algorithm="auto")
    return decisions()[before:]


__all__ = ["cache_path", "calls_to_decide", "decisions", "tune"]
