"""One shape, every requested row, one run: probe which rows can run, check each row's result against the float64
reference, time them all on the same inputs, and summarise with the formulas of
docs/decisions/0012-benchmark-measures.md. Every rank returns the same
summary (raw timings of every rank included)."""
import hashlib
import os
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from . import metrics
from .dist_env import DistEnv
from .inputs import make_references, make_sets
from .rows import COMM, PIPELINED, SEQUENTIAL, build_rows, is_not_available
from .timing import gather_timed, time_rows


@dataclass
class Shape:
    m: int
    k: int
    n: int
    dtype: torch.dtype
    bias: bool = False


@dataclass
class Settings:
    seed: int = 0
    input_sets: int = 3
    warmup: int = 3
    iters: Optional[int] = 10  # None: as many as fit in budget_s
    budget_s: float = 0.0
    min_iters: int = 3
    max_iters: int = 50
    check: bool = True


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _probe_and_check(env: DistEnv, rows, references) -> Dict[str, dict]:
    """Runs every row once on input set 0 (this is also its first warm-up call). A row whose call raises "not
    available" on any rank is absent on every rank; any other error is a real failure and propagates."""
    local = {}
    for key, row in rows.items():
        if row.prepare is not None:
            row.prepare(0)
        try:
            out = row.run(0)
        except RuntimeError as exc:
            if not is_not_available(exc):
                raise
            local[key] = {"available": False, "reason": str(exc).strip().splitlines()[0]}
            continue
        env.synchronize()
        entry = {"available": True, "digest": _digest(out)}
        if references is not None and row.reference is not None:
            want = getattr(references, row.reference)
            got = out.detach().cpu().double().reshape(want.shape)
            entry["max_abs_error"] = float((got - want).abs().max()) if want.numel() else 0.0
            entry["max_abs_reference"] = float(want.abs().max()) if want.numel() else 0.0
        local[key] = entry
        del out
    gathered: List[Dict[str, dict]] = [None] * env.world
    dist.all_gather_object(gathered, local, group=env.group)
    merged = {}
    for key in local:
        per_rank = [g[key] for g in gathered]
        absent = [e for e in per_rank if not e["available"]]
        if absent:
            merged[key] = {"available": False, "reason": absent[0]["reason"]}
            continue
        # Only a reduced result must be the same tensor everywhere; a GEMM alone differs per rank by design.
        reduced = rows[key].reference not in ("local", None)
        same = len({e["digest"] for e in per_rank}) == 1 if reduced else None
        entry = {"available": True, "identical_on_all_ranks": same}
        if references is not None and rows[key].reference is not None:
            worst = max(per_rank, key=lambda e: metrics.relative_error(e["max_abs_error"], e["max_abs_reference"]))
            entry["max_abs_error"] = worst["max_abs_error"]
            entry["max_rel_error"] = metrics.relative_error(worst["max_abs_error"], worst["max_abs_reference"])
        merged[key] = entry
    return merged


def measure_shape(env: DistEnv, shape: Shape, row_keys: List[str], settings: Settings) -> dict:
    sets = make_sets(settings.seed, settings.input_sets, env.rank, shape.m, shape.k, shape.n, shape.dtype,
                     shape.bias, env.device)
    references = (make_references(settings.seed, env.world, env.rank, shape.m, shape.k, shape.n, shape.dtype,
                                  shape.bias) if settings.check else None)
    rows = build_rows(env, sets, shape.dtype, row_keys)
    tune = getattr(env.library, "tune", None)
    auto_choice = None
    if "auto" in rows and tune is not None and os.environ.get("TORCH_GEMM_AR_AUTOTUNE", "1") != "0":
        # auto's first calls on a shape time every candidate: decide before timing, as a server would with tune().
        k = sets[0].a.shape[-1]
        tune([(shape.m, k, shape.n)], env.group, shape.dtype, bias=shape.bias, device=env.device)
        auto_choice = _decided(env.library, shape, k, env.group, env.device)
    status = _probe_and_check(env, rows, references)
    for key, entry in status.items():
        if not entry["available"]:
            rows[key].absent_reason = entry["reason"]
    # The probe was one warm-up call of every row; the rest follow inside time_rows.
    local_times = time_rows(env, list(rows.values()), settings.input_sets, max(settings.warmup - 1, 0),
                            settings.iters, settings.budget_s, settings.min_iters, settings.max_iters)
    all_times, one_clock = gather_timed(env, local_times)
    summary = summarize(env.world, shape, rows, status, all_times, settings, one_clock)
    summary["auto_choice"] = auto_choice
    return summary


def _decided(library, shape: Shape, k: int, group, device) -> Optional[str]:
    """The algorithm `auto` decided for the shape's bucket (measured now or earlier, or from the tune cache)."""
    decision_for = getattr(library.tuning, "decision_for", None)
    if decision_for is None:  # a build of the library before decision_for
        return None
    return decision_for(shape.m, k, shape.n, shape.dtype, bias=shape.bias, group=group, device=str(device))


def summarize(world: int, shape: Shape, rows, status: Dict[str, dict], all_times, settings: Settings,
              one_clock: bool) -> dict:
    """The JSON-ready result: per row its raw per-rank timings, statistics and the derived numbers of
    docs/decisions/0012-benchmark-measures.md."""
    out_rows = {}
    for key, row in rows.items():
        entry = {"label": row.label, "kind": row.kind, "note": row.note or None}
        entry.update(status.get(key, {}))
        if entry.get("available"):
            entry.update(metrics.row_stats([times[key] for times in all_times], one_clock))
        else:
            entry.setdefault("available", False)
        out_rows[key] = entry
    _derive(world, shape, rows, out_rows)
    ratios = {}
    for reference, keys in (("compute_only", ("fused", "engine_gemm", "traffic_floor")),
                            ("compute_reused", ("fused",)), ("fused_private", ("fused",)),
                            ("traffic_floor", ("fused",))):
        if not out_rows.get(reference, {}).get("available"):
            continue
        for key in keys:
            if out_rows.get(key, {}).get("available"):
                ratios[f"{key}_over_{reference}"] = out_rows[key]["median_s"] / out_rows[reference]["median_s"]
                # Per iteration (the two ran moments apart) with a 95% interval: how sure one run is of the ratio
                # (a ratio of two medians moves between runs on a shared machine).
                paired = metrics.paired_speedup(out_rows[key]["iteration_s"], out_rows[reference]["iteration_s"])
                ratios[f"{key}_over_{reference}_paired"] = {k: paired[k] for k in ("estimate", "low", "high")}
    return {
        "shape": {"m": shape.m, "k": shape.k, "n": shape.n, "dtype": str(shape.dtype).replace("torch.", ""),
                  "bias": shape.bias, "world": world, "flops_per_rank": metrics.gemm_flops(shape.m, shape.k, shape.n)},
        "settings": {"seed": settings.seed, "input_sets": settings.input_sets, "warmup": settings.warmup,
                     "iters": _timed_iterations(all_times),
                     "checked_against_float64": settings.check},
        "rows": out_rows,
        "ratios": ratios,
    }


def _timed_iterations(all_times) -> int:
    return max((len(times) for times in all_times[0].values()), default=0)


def _median(out_rows, key) -> Optional[float]:
    entry = out_rows.get(key)
    return entry["median_s"] if entry and entry.get("available") else None


def _derive(world: int, shape: Shape, rows, out_rows):
    t_comp = _median(out_rows, "compute_only")
    t_base = _median(out_rows, "baseline")
    for key, row in rows.items():
        entry = out_rows[key]
        if not entry.get("available"):
            continue
        t = entry["median_s"]
        entry["gflops"] = metrics.gflops(shape.m, shape.k, shape.n, t) if row.kind != COMM else None
        # Only rows that deliver the whole result compete with the baseline.
        whole = row.reference == "reduced"
        entry["speedup_vs_baseline"] = metrics.speedup(t_base, t) if t_base is not None and whole else None
        # What this row's communication costs: all of a comm-only row; the part after compute of a sequential row; the
        # whole call of a pipelined row ("comm done" in pto-isa's gemm_ar example). Baselines: see the all_reduce-only
        # row.
        comm = None
        if row.kind == COMM or row.kind == PIPELINED:
            comm = t
        elif row.kind == SEQUENTIAL and t_comp is not None:
            comm = metrics.comm_time(t, t_comp)
            entry["comm_s"] = comm
        entry["bus_gbs"] = metrics.bus_bandwidth_gbs(shape.m, shape.n, row.element_bytes, world, comm)
        t_seq = _median(out_rows, row.sequential_ref) if row.sequential_ref else None
        entry["sequential_reference"] = row.sequential_ref if t_seq is not None else None
        if t_seq is not None:
            entry["speedup_vs_sequential"] = metrics.speedup(t_seq, t)
            entry["time_saved_s"] = metrics.time_saved(t_seq, t)
            if t_comp is not None:
                t_comm = metrics.comm_time(t_seq, t_comp)
                entry["overlap_efficiency"] = metrics.overlap_efficiency(t_comp, t_comm, t)
    for entry in out_rows.values():
        for name in ("speedup_vs_sequential", "time_saved_s", "overlap_efficiency", "sequential_reference"):
            entry.setdefault(name, None)
        if entry.get("available"):
            entry.setdefault("comm_s", None)
    # A CPU half-precision baseline runs torch's half GEMM while the library computes in fp32: say so by the numbers.
    if "baseline_fp32" in out_rows and "baseline" in out_rows:
        out_rows["baseline"]["note"] = (f"torch's CPU GEMM in {str(shape.dtype).replace('torch.', '')}; the library "
                                        "computes it in fp32: compare with the fp32-compute baseline")
