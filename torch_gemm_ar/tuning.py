"""`algorithm="auto"` by measurement: what the tuner decided, where it keeps its decisions, and `tune()` to decide
before serving or before graph capture.

The first calls of a group on a shape bucket (M rounded up to a power of two, K, N, dtype, bias, device, op) race the
candidate algorithms in rounds: after one warm-up run each (not counted: a first call at a new shape grows windows
and touches fresh pages; its time counts against the budget), each runs TORCH_GEMM_AR_AUTOTUNE_REPS times (default
3); from its 4th run on, a
candidate over 2% slower than the leader in at least three of every four rounds (its paired ratios) leaves the
race, and the rest run more rounds while the bucket's tuning stays within TORCH_GEMM_AR_AUTOTUNE_BUDGET_MS (default
2000), up to TORCH_GEMM_AR_AUTOTUNE_MAX_REPS (default 25) runs. The leader and winner is the candidate with the lowest
median of its runs relative to each round's fastest run (a round's candidates run back to back, so a slow spell of
the machine cancels out). Every call returns its correct result.
Each rank times its own calls and passes its times to the others inside the next call's signature, so no extra
collective runs and every rank takes the same decision: on one host a run counts from its last rank's start to its
last rank's end (an early rank's wait for a late one is not the algorithm's cost), else with its slowest rank's time.
Decisions are logged on the `torch_gemm_ar.tuning` logger and kept in memory per group, and in a JSON file per host
fingerprint (CPU model, cores, library and torch versions): TORCH_GEMM_AR_TUNE_CACHE, by default
$XDG_CACHE_HOME/torch_gemm_ar/autotune.json (~/.cache/...). A cached decision is used when every rank of the group
has the same one. Writing a decision (under a lock file beside it) keeps other processes' decisions, other hosts'
sections and this host's sections of the 4 builds that wrote last. TORCH_GEMM_AR_AUTOTUNE=0 keeps the static policy
(docs/usage.md, "`auto` by measurement").
"""
import logging
import os
from typing import Iterable, List, Optional, Sequence

import torch

from . import _C
from ._groups import GroupLike, group_name_of
from ._ops import gemm_allreduce

logger = logging.getLogger("torch_gemm_ar.tuning")
_C._set_tuner_logger(logger.info)

# Candidates per bucket at most (fused, and on the CPU engine fused with the other tile family and the
# gathered-inputs flow, sequential, chunked): tune() makes enough calls for any bucket.
_MAX_CANDIDATES = 5


def decisions() -> List[dict]:
    """Every decision this process took: group, bucket, algorithm, source ("measured" or "cache") and, when
    measured, `candidate_us`: each candidate's time in microseconds (the median of its runs), `candidate_runs`:
    how many runs it had (fewer when it left the race early) and `candidate_relative`: the median of its runs over
    the fastest run of their rounds (the winner has the lowest)."""
    return list(_C._tuner_decisions())


def decision_for(m: int, k: int, n: int, dtype: torch.dtype = torch.float32, *, bias: bool = False,
                 group: GroupLike = None, device: str = "cpu") -> Optional[str]:
    """The algorithm `auto` runs for gemm_allreduce calls of M x K x N (K: this rank's shard) on `group`, once this
    process has decided their bucket (measured, or from the tune cache); None until then. Besides the `algorithm=`
    names, the CPU engine's "fused/tiles" and "fused/few-products": fused with the tile family the geometry rules did
    not pick, measured faster here."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if isinstance(group, str):
        group = _resolve_process_group(group)
    group_name = group_name_of(group, "decision_for")  # the library's message for what is not a usable group
    world = dist.get_world_size(group)
    if world < 1:
        raise ValueError(f"decision_for: this rank is not a member of group {group_name!r}")
    name = _C._tuner_decision_for(group_name, world, int(m), int(k), int(n), dtype, bool(bias), str(device))
    return name or None


def cache_path() -> str:
    """The JSON file that keeps decisions across processes (TORCH_GEMM_AR_TUNE_CACHE or the default)."""
    return _C._tuner_cache_path()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return max(1, int(value))
    except ValueError:
        raise ValueError(f"{name} must be an integer; got {value!r}") from None


def calls_to_decide() -> int:
    """The most calls on one shape bucket `auto` may spend tuning before it has decided (small calls take the
    most; in_progress() says when tuning is over)."""
    reps = max(_env_int("TORCH_GEMM_AR_AUTOTUNE_REPS", 3), _env_int("TORCH_GEMM_AR_AUTOTUNE_MAX_REPS", 25))
    return _MAX_CANDIDATES * (reps + 1) + 1  # + 1 run each: the warm-up round, not counted


def in_progress(group: GroupLike = None) -> bool:
    """Whether `auto` is still tuning a shape bucket of `group` (None: of any group) in this process. Ranks of a
    group make the same calls, so they see the same answer: warm a model up until it is False before timing it."""
    return _C._tuner_in_progress(group_name_of(group, "tuning.in_progress") if group is not None else "")


def _any_rank_tuning(group: GroupLike) -> bool:
    """in_progress(group) on any rank of the default group: the ranks agree to stop together. A rank's own answer can
    differ (group=None covers every group of the process; pipeline stages meet different shapes), and a rank that
    stopped while another runs `step()` again would leave that one waiting in a collective."""
    import torch.distributed as dist

    busy = in_progress(group)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return busy
    # The device the default group's collectives take (CPU with gloo; the accelerator when it has only that).
    device_type = dist.distributed_c10d._get_object_coll_device()
    device = torch.device(device_type) if device_type == "cpu" else torch.device(
        device_type, torch.get_device_module(device_type).current_device())
    flag = torch.tensor([1 if busy else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def warm_up_until_tuned(step, min_steps: int = 1, group: GroupLike = None) -> int:
    """Runs `step()` min_steps times, then until `auto` has decided every shape bucket the step meets on every rank
    (at most calls_to_decide() more times). Returns how many steps ran, the same on every rank. Collective over the
    default group: call it on every rank."""
    ran = 0
    for _ in range(min_steps):
        step()
        ran += 1
    for _ in range(calls_to_decide()):
        if not _any_rank_tuning(group):
            break
        step()
        ran += 1
    return ran


# The decode buckets tune(decode=True) adds per (K, N): M rounded up to a power of two, up to the CPU engine's decode
# calls' 64 rows (docs/usage.md, "Decode").
DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)


def tune(shapes: Iterable[Sequence[int]], group: GroupLike = None, dtype: torch.dtype = torch.float32, *,
         bias: bool = False, device: Optional[torch.device] = None, decode: bool = False) -> List[dict]:
    """Decides `auto` for each (M, K, N) on `group` now, with random inputs: M rows, this rank's K (the shard),
    N outputs, on `device` (default CPU; pass the rank's NPU to tune its calls there, timed by device events).
    With decode=True, also every decode bucket of each (K, N): M in DECODE_ROWS (one token per step up to 64).
    Collective: every rank of the group calls it with the same arguments. Returns the decisions taken (none for
    buckets already decided in this process or with a single candidate)."""
    shapes = [tuple(int(v) for v in s) for s in shapes]
    for s in shapes:
        if len(s) != 3 or min(s) < 1:
            raise ValueError(f"tune: every shape must be (M, K, N) with positive sizes; got {s}")
    if decode:
        kn = list(dict.fromkeys((k, n) for _, k, n in shapes))
        shapes = shapes + [(m, k, n) for k, n in kn for m in DECODE_ROWS if (m, k, n) not in shapes]
    if os.environ.get("TORCH_GEMM_AR_AUTOTUNE", "1") == "0":
        raise RuntimeError("tune: TORCH_GEMM_AR_AUTOTUNE=0 disables measured auto (the static policy applies)")
    before = len(decisions())
    generator = torch.Generator().manual_seed(0)
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=generator).to(device=device, dtype=dtype)
        b = torch.randn(k, n, generator=generator).to(device=device, dtype=dtype)
        bias_t = torch.randn(n, generator=generator).to(device=device, dtype=dtype) if bias else None
        # Until decided (the same count on every rank: they see the same samples); a bucket already decided, or
        # with one candidate, needs the one call.
        warm_up_until_tuned(lambda: gemm_allreduce(a, b, group, bias=bias_t, algorithm="auto"), 1, group)
    return decisions()[before:]


__all__ = ["DECODE_ROWS", "cache_path", "calls_to_decide", "decision_for", "decisions", "in_progress", "tune",
           "warm_up_until_tuned"]
