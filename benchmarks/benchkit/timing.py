"""Per-rank timing of the rows, by the conventions of every benchmark here: warm-up first, then timed iterations that
rotate the input sets and, per iteration, go round-robin over the rows (noise from a shared machine hits every row
alike), in orders of a Williams design, so that over its iterations every row comes right after every other equally
often (what ran just before a call changes its time, by more than the gaps between rows; merely starting each
iteration one row further on keeps every row's predecessor; docs/journal/performance-journal.md); a barrier
before each timed call so all ranks start together; the host's monotonic clock read on both sides of the call, with
the device synchronized on both sides (NPU). Each timed call is kept as its (start, end) on that clock: on one host,
metrics.row_stats counts an iteration from its last rank's start to its last rank's end, so how far apart a gloo
barrier releases the ranks (up to milliseconds on a loaded machine) is in no row's time."""
import socket
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import metrics
from .dist_env import DistEnv
from .rows import COMPUTE, Row


def agree_max(env: DistEnv, value: float) -> float:
    """The largest of every rank's value, so that decisions taken from timings are the same on every rank."""
    t = torch.tensor([value], dtype=torch.float32, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=env.group)
    return float(t.item())


def now() -> float:
    """Seconds on the host's monotonic clock, which every process of a host reads alike (CLOCK_MONOTONIC)."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def clock_domain() -> str:
    """Which monotonic clock this process reads: ranks with the same domain share one time line."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def gather_timed(env: DistEnv, payload) -> Tuple[list, bool]:
    """Every rank's `payload` (its time_rows result, and whatever goes with it), and whether all ranks read one
    monotonic clock (metrics.row_stats' one_clock). Collective."""
    gathered = [None] * env.world
    dist.all_gather_object(gathered, (payload, clock_domain()), group=env.group)
    return [p for p, _ in gathered], len({domain for _, domain in gathered}) == 1


def timed_call(env: DistEnv, row: Row, set_index: int) -> Tuple[float, float]:
    """The call's (start, end) on the host's monotonic clock."""
    if row.prepare is not None:
        row.prepare(set_index)
    env.synchronize()
    env.barrier()
    start = now()
    out = row.run(set_index)
    env.synchronize()
    end = now()
    del out
    return start, end


def williams_orders(n: int) -> List[List[int]]:
    """Orders of n rows in which every row comes right after every other row equally often (a Williams design:
    n orders for an even n, 2n for an odd n)."""
    if n <= 1:
        return [list(range(n))]
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    orders = [[(r + shift) % n for r in first] for shift in range(n)]
    return orders if n % 2 == 0 else orders + [order[::-1] for order in orders]


def iterations_for_budget(env: DistEnv, round_s: float, budget_s: float, min_iters: int, max_iters: int) -> int:
    """How many timed rounds fit in budget_s, given one round over all rows takes round_s (agreed on all ranks)."""
    round_s = agree_max(env, round_s)
    return int(min(max_iters, max(min_iters, budget_s // max(round_s, 1e-9))))


def time_rows(env: DistEnv, rows: List[Row], n_sets: int, warmup: int, iters: Optional[int],
              budget_s: float = 0.0, min_iters: int = 3, max_iters: int = 50) -> Dict[str, List[Tuple[float, float]]]:
    """This rank's timed iterations per row key, each its (start, end) in seconds on the host's monotonic clock
    (metrics.row_stats turns every rank's into the row's times). With iters=None the count comes from budget_s."""
    rows = [r for r in rows if r.absent_reason is None]
    if iters is None:
        warmup = max(warmup, 1)  # the budget is split by the time of one warm-up round
    warm_start = now()
    for w in range(warmup):
        for row in rows:
            timed_call(env, row, w % n_sets)
    if iters is None:
        round_s = (now() - warm_start) / max(warmup, 1)
        iters = iterations_for_budget(env, round_s, budget_s, min_iters, max_iters)
    times: Dict[str, List[Tuple[float, float]]] = {row.key: [] for row in rows}
    orders = williams_orders(len(rows))  # the same on every rank: the rows' collectives stay matched
    for it in range(iters):
        set_index = (warmup + it) % n_sets
        for r in orders[it % len(orders)]:
            times[rows[r].key].append(timed_call(env, rows[r], set_index))
    return times


def time_callables(fns: List[Callable[[], object]], warmup: int, iters: int, group=None) -> List[List[float]]:
    """For scripts that time whole steps rather than table rows (the examples): each of `fns` timed as a row of
    time_rows, by the same conventions (interleaved in Williams orders, a barrier before each call), on the CPU ranks
    of `group` (None: the default group). Per function, its iteration times in seconds over all ranks, as
    metrics.row_stats counts them. Collective."""
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    env = DistEnv(rank=rank, world=dist.get_world_size(group), local_rank=rank, device=torch.device("cpu"),
                  threads=torch.get_num_threads(), group=group, self_group=None, library=None,
                  synchronize=lambda: None)
    rows = [Row(key=str(i), label=str(i), kind=COMPUTE, run=lambda _set, fn=fn: fn(), reference="local",
                element_bytes=0) for i, fn in enumerate(fns)]
    local = time_rows(env, rows, n_sets=1, warmup=warmup, iters=iters)
    every_rank, one_clock = gather_timed(env, local)
    return [metrics.row_stats([times[row.key] for times in every_rank], one_clock)["iteration_s"] for row in rows]
