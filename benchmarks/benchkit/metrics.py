"""The numbers the benchmarks report, in the terms of pto-isa's gemm_ar example
(docs/decisions/0012-benchmark-measures.md). Pure functions of times in seconds, so they can be checked against that
example's published figures without running anything."""
import random
import statistics
from typing import Dict, List, Optional, Sequence


def row_stats(per_rank_stamps: Sequence[Sequence[Sequence[float]]], one_clock: bool) -> Dict[str, object]:
    """A row's times from every rank's timed iterations, each its (start, end). On one clock (ranks of one host) an
    iteration counts from its last rank's start to its last rank's end: what a tensor-parallel step waits for once
    every rank has arrived (how far apart a barrier releases the ranks is no row's cost). Otherwise the iteration's
    slowest rank. median_s is the median over iterations; min/max the fastest and slowest iteration;
    timings_s and rank_medians_s each rank's own durations and their medians."""
    durations = [[end - start for start, end in stamps] for stamps in per_rank_stamps]
    iterations = min(len(stamps) for stamps in per_rank_stamps)
    if one_clock:
        group = [max(stamps[i][1] for stamps in per_rank_stamps) - max(stamps[i][0] for stamps in per_rank_stamps)
                 for i in range(iterations)]
    else:
        group = [max(times[i] for times in durations) for i in range(iterations)]
    return {
        "median_s": statistics.median(group),
        "min_s": min(group),
        "max_s": max(group),
        "iteration_s": group,
        "timings_s": durations,
        "rank_medians_s": [statistics.median(times) for times in durations],
        "one_clock": one_clock,
    }


def paired_speedup(reference_iters: Sequence[float], iters: Sequence[float], resamples: int = 400,
                   seed: int = 0) -> Dict[str, float]:
    """How many times faster a row is than a reference row measured in the same iterations: the median over
    iterations of reference_i / t_i (each pair ran moments apart, so a slow phase of a shared machine hits both),
    with a 95% bootstrap interval over the iterations (a fixed seed: the same data give the same interval)."""
    ratios = [r / t for r, t in zip(reference_iters, iters)]
    estimate = statistics.median(ratios)
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return {"estimate": estimate, "low": medians[int(0.025 * (resamples - 1))],
            "high": medians[int(0.975 * (resamples - 1))], "iterations": len(ratios)}


def speedup(reference_s: float, t_s: float) -> float:
    """reference / t: above 1 means t is faster (pto-isa's gemm_ar example's speedup is sequential / pipelined)."""
    return reference_s / t_s


def time_saved(sequential_s: float, pipelined_s: float) -> float:
    return sequential_s - pipelined_s


def comm_time(sequential_s: float, compute_s: float) -> Optional[float]:
    """The communication part of a run that communicates only after computing (pto-isa's gemm_ar example splits its
    sequential time this way); None when the difference is not positive, i.e. noise swamps the communication."""
    t = sequential_s - compute_s
    return t if t > 0 else None


def overlap_efficiency(compute_s: float, comm_s: Optional[float], pipelined_s: float) -> Optional[float]:
    """(t_comp + t_comm - t_pipe) / min(t_comp, t_comm): the fraction of the shorter phase hidden under the longer
    one. 1 = perfectly hidden, 0 = no overlap, negative = the pipelined run is slower than compute then comm."""
    if comm_s is None or comm_s <= 0 or compute_s <= 0:
        return None
    return (compute_s + comm_s - pipelined_s) / min(compute_s, comm_s)


def gemm_flops(m: int, k: int, n: int) -> int:
    """Floating-point operations of one rank's GEMM: 2*M*K*N."""
    return 2 * m * k * n


def gflops(m: int, k: int, n: int, t_s: float) -> float:
    return gemm_flops(m, k, n) / t_s / 1e9


def allreduce_bus_bytes(m: int, n: int, element_bytes: int, world: int) -> float:
    """Bytes each rank moves in a reduce-scatter plus all-gather of an M x N buffer: (W-1)/W of the buffer in each
    phase. Dividing by time gives the bus bandwidth of nccl-tests, comparable across world sizes."""
    return 2.0 * (world - 1) / world * m * n * element_bytes


def bus_bandwidth_gbs(m: int, n: int, element_bytes: int, world: int, t_s: Optional[float]) -> Optional[float]:
    if t_s is None or t_s <= 0 or world < 2:
        return None
    return allreduce_bus_bytes(m, n, element_bytes, world) / t_s / 1e9


def relative_error(max_abs_error: float, max_abs_reference: float) -> float:
    """max |out - ref| / max |ref| (ref in float64); 0 for an exact match."""
    return max_abs_error / max_abs_reference if max_abs_reference > 0 else max_abs_error


def first_index_from_which(values: List[bool]) -> Optional[int]:
    """The first index i such that values[i:] are all True (None if the last value is False): where an algorithm
    starts to win and keeps winning for every larger size measured."""
    start = None
    for i, ok in enumerate(values):
        if ok and start is None:
            start = i
        elif not ok:
            start = None
    return start
