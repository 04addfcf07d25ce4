"""Per-rank timing of the rows, by the conventions of every benchmark here: warm-up first, then timed iterations
that rotate the input sets and, per iteration, go round-robin over the rows (noise from a shared machine hits every
row alike), starting each iteration one row further on, so that every row follows every other equally often (a
call right after a gloo collective runs slower than one after an engine call; in a fixed order the row after
`fused` measured up to 1.35x faster than `fused` itself on a 2-core VM); a barrier before each timed call so all ranks start together; time.perf_counter around the call, with
the device synchronized on both sides (NPU)."""
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .dist_env import DistEnv
from .rows import Row


def agree_max(env: DistEnv, value: float) -> float:
    """The largest of every rank's value, so that decisions taken from timings are the same on every rank."""
    t = torch.tensor([value], dtype=torch.float32, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=env.group)
    return float(t.item())


def timed_call(env: DistEnv, row: Row, set_index: int) -> float:
    if row.prepare is not None:
        row.prepare(set_index)
    env.synchronize()
    env.barrier()
    start = time.perf_counter()
    out = row.run(set_index)
    env.synchronize()
    elapsed = time.perf_counter() - start
    del out
    return elapsed


def iterations_for_budget(env: DistEnv, round_s: float, budget_s: float, min_iters: int, max_iters: int) -> int:
    """How many timed rounds fit in budget_s, given one round over all rows takes round_s (agreed on all ranks)."""
    round_s = agree_max(env, round_s)
    return int(min(max_iters, max(min_iters, budget_s // max(round_s, 1e-9))))


def time_rows(env: DistEnv, rows: List[Row], n_sets: int, warmup: int, iters: Optional[int],
              budget_s: float = 0.0, min_iters: int = 3, max_iters: int = 50) -> Dict[str, List[float]]:
    """This rank's timed iterations per row key (seconds). With iters=None the count comes from budget_s."""
    rows = [r for r in rows if r.absent_reason is None]
    if iters is None:
        warmup = max(warmup, 1)  # the budget is split by the time of one warm-up round
    warm_start = time.perf_counter()
    for w in range(warmup):
        for row in rows:
            timed_call(env, row, w % n_sets)
    if iters is None:
        round_s = (time.perf_counter() - warm_start) / max(warmup, 1)
        iters = iterations_for_budget(env, round_s, budget_s, min_iters, max_iters)
    times: Dict[str, List[float]] = {row.key: [] for row in rows}
    for it in range(iters):
        set_index = (warmup + it) % n_sets
        first = it % len(rows)  # the same on every rank: the rows' collectives stay matched
        for row in rows[first:] + rows[:first]:
            times[row.key].append(timed_call(env, row, set_index))
    return times
