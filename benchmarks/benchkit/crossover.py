"""What a sweep over M says about `auto`: per layer, from which M each overlapping algorithm beats `sequential` for
good, the thresholds that would follow, and per point how `auto` compares with the torch baseline (floor 0.98x) and
with the best single algorithm measured there (floor 0.97x: auto should pick it). Those comparisons pair the rows'
iterations (metrics.paired_speedup): a point is below a floor when its whole 95% interval is, and "under the floor
within noise" when only its estimate is (auto and the best row then often ran the same algorithm: see auto_choice)."""
from typing import Dict, List, Optional

from . import metrics

AUTO_FLOOR = 0.98  # auto may never be slower than this fraction of the baseline's speed
AUTO_BEST_FLOOR = 0.97  # ... nor than this fraction of the speed of the best single algorithm at that point
CANDIDATES = ("chunked", "fused")
SINGLE_ALGORITHMS = ("sequential", *CANDIDATES)


def _iterations(point: dict, key: str) -> Optional[List[float]]:
    entry = point["rows"].get(key, {})
    return entry.get("iteration_s") if entry.get("available") else None


def _median(point: dict, key: str) -> Optional[float]:
    entry = point["rows"].get(key, {})
    return entry.get("median_s") if entry.get("available") else None


def layer_crossovers(ms: List[int], points: List[dict]) -> Dict[str, Optional[int]]:
    """For each candidate: the smallest measured M from which it is faster than sequential at every larger M
    (None: it never settles in front, or it was not measured)."""
    out = {}
    for candidate in CANDIDATES:
        wins = []
        for point in points:
            t_seq, t_cand = _median(point, "sequential"), _median(point, candidate)
            wins.append(t_seq is not None and t_cand is not None and t_cand < t_seq)
        index = metrics.first_index_from_which(wins)
        out[candidate] = ms[index] if index is not None else None
    return out


def best_algorithm(point: dict) -> Optional[str]:
    times = {k: _median(point, k) for k in SINGLE_ALGORITHMS}
    times = {k: t for k, t in times.items() if t is not None}
    return min(times, key=times.get) if times else None


def analyse(layer_names: List[str], ms: List[int], points_by_layer: List[List[dict]]) -> dict:
    crossovers = {name: layer_crossovers(ms, pts) for name, pts in zip(layer_names, points_by_layer)}
    recommended = {}
    for candidate in CANDIDATES:
        values = [c[candidate] for c in crossovers.values()]
        # Conservative: the candidate must win on every layer from the threshold on; None if some layer never wins.
        recommended[f"min_m_for_{candidate}"] = max(values) if values and all(v is not None for v in values) else None
    auto_ratios, auto_vs_best = [], []
    for name, pts in zip(layer_names, points_by_layer):
        for m, point in zip(ms, pts):
            t_auto, t_base = _iterations(point, "auto"), _iterations(point, "baseline")
            choice = point.get("auto_choice")
            if t_auto is not None and t_base is not None:
                speed = metrics.paired_speedup(t_base, t_auto)
                auto_ratios.append({"layer": name, "m": m, "auto_choice": choice,
                                    "speed_vs_baseline": speed["estimate"], "interval": [speed["low"], speed["high"]]})
            best = best_algorithm(point)
            if t_auto is not None and best is not None:
                speed = metrics.paired_speedup(_iterations(point, best), t_auto)
                auto_vs_best.append({"layer": name, "m": m, "best": best, "auto_choice": choice,
                                     "speed_vs_best": speed["estimate"], "interval": [speed["low"], speed["high"]]})
    worst = min(auto_ratios, key=lambda r: r["speed_vs_baseline"]) if auto_ratios else None
    worst_vs_best = min(auto_vs_best, key=lambda r: r["speed_vs_best"]) if auto_vs_best else None
    return {
        "crossovers": crossovers,
        "recommended_thresholds": recommended,
        "best_by_layer": {name: [best_algorithm(p) for p in pts] for name, pts in zip(layer_names, points_by_layer)},
        "auto_floor": AUTO_FLOOR,
        "auto_worst": worst,
        "auto_below_floor": [r for r in auto_ratios if r["interval"][1] < AUTO_FLOOR],
        "auto_under_floor_within_noise": [r for r in auto_ratios
                                          if r["speed_vs_baseline"] < AUTO_FLOOR <= r["interval"][1]],
        "auto_vs_best": auto_vs_best,
        "auto_best_floor": AUTO_BEST_FLOOR,
        "auto_worst_vs_best": worst_vs_best,
        "auto_below_best_floor": [r for r in auto_vs_best if r["interval"][1] < AUTO_BEST_FLOOR],
        "auto_under_best_floor_within_noise": [r for r in auto_vs_best
                                               if r["speed_vs_best"] < AUTO_BEST_FLOOR <= r["interval"][1]],
        "auto_chose_best": sum(1 for r in auto_vs_best if r["auto_choice"] == r["best"]),
        # fused/tiles and fused/few-products: auto ran the best row's algorithm with a tile family it measured faster
        "auto_chose_best_family": sum(1 for r in auto_vs_best
                                      if r["auto_choice"] and r["auto_choice"] != r["best"]
                                      and r["auto_choice"].split("/")[0] == r["best"]),
    }
