"""What rank 0 prints and saves: a header that says exactly how to reproduce the run, one aligned table per shape,
and the JSON file (every rank's raw timings plus the summary)."""
import datetime
import json
import os
import platform
from typing import Dict, List, Optional, Sequence

import torch

from . import dist_env

# (title, summary key, formatter); a value of None prints as "-".
TABLE_COLUMNS = (
    ("algorithm", "label", str),
    ("median us", "median_s", lambda s: f"{s * 1e6:,.1f}"),
    ("min us", "min_s", lambda s: f"{s * 1e6:,.1f}"),
    ("max us", "max_s", lambda s: f"{s * 1e6:,.1f}"),
    ("vs base", "speedup_vs_baseline", lambda x: f"{x:.3f}x"),
    ("vs seq", "speedup_vs_sequential", lambda x: f"{x:.3f}x"),
    ("saved us", "time_saved_s", lambda s: f"{s * 1e6:,.1f}"),
    ("overlap", "overlap_efficiency", lambda x: f"{x * 100:.1f}%"),
    ("GFLOP/s", "gflops", lambda x: f"{x:,.1f}"),
    ("bus GB/s", "bus_gbs", lambda x: f"{x:.2f}"),
    ("rel err", "max_rel_error", lambda x: f"{x:.1e}"),
    ("same", "identical_on_all_ranks", lambda b: "yes" if b else "NO"),
)


def format_table(headers: Sequence[str], body: List[Sequence[str]], right_from: int = 1) -> str:
    """Aligned plain-text table: first `right_from` columns left-aligned (names), the rest right-aligned (numbers).
    A body row with fewer cells than headers is a name followed by free text (e.g. why a row is absent)."""
    widths = [len(h) for h in headers]
    for cells in body:
        if len(cells) == len(headers):
            widths = [max(w, len(c)) for w, c in zip(widths, cells)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < right_from else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [line(headers), rule]
    for cells in body:
        if len(cells) == len(headers):
            out.append(line(cells))
        else:
            out.append("  ".join([cells[0].ljust(widths[0]), *cells[1:]]).rstrip())
    return "\n".join(out)


def interval(paired: dict) -> str:
    return f"{paired['estimate']:.3f} ({paired['low']:.3f}-{paired['high']:.3f})"


def _cell(entry: dict, key: str, fmt) -> str:
    value = entry.get(key)
    return "-" if value is None else fmt(value)


def shape_table(summary: dict) -> str:
    headers = [title for title, _, _ in TABLE_COLUMNS]
    body, notes = [], []
    for key, entry in summary["rows"].items():
        if entry.get("available"):
            body.append([_cell(entry, k, fmt) for _, k, fmt in TABLE_COLUMNS])
        else:
            reason = entry.get("reason", "not measured").replace("gemm_allreduce: ", "", 1)
            body.append([entry["label"], f"absent: {reason}"])
        if entry.get("note"):
            notes.append(f"{entry['label']}: {entry['note']}" if not entry["note"].startswith("*") else entry["note"])
    shape = summary["shape"]
    dtype = shape["dtype"]
    title = (f"M={shape['m']} K={shape['k']} N={shape['n']} {dtype}{' +bias' if shape['bias'] else ''}, "
             f"{shape['world']} ranks, {summary['settings']['iters']} timed iterations per row")
    lines = [title, format_table(headers, body)]
    ratios = summary.get("ratios", {})
    for key, label, target in (("engine_gemm", "engine GEMM only", ENGINE_GEMM_TARGET),
                               ("fused", "fused", fused_target(dtype))):
        if ratios.get(f"{key}_over_compute_only") is not None:
            lines.append(f"{label} / compute-only = {target_cell(ratios.get(f'{key}_over_compute_only_paired'), target)}"
                         f" (target <= {target:.2f}; the ratio of the medians: {ratios[f'{key}_over_compute_only']:.3f})")
    if ratios.get("fused_over_compute_reused") is not None:
        target = fused_target(dtype)
        lines.append(f"fused / compute-only into a reused output = "
                     f"{target_cell(ratios.get('fused_over_compute_reused_paired'), target)} (the same target, "
                     f"without the fresh output's page faults; the ratio of the medians: "
                     f"{ratios['fused_over_compute_reused']:.3f})")
    floor = ratios.get("traffic_floor_over_compute_only_paired")
    over_floor = ratios.get("fused_over_traffic_floor_paired")
    if floor is not None and over_floor is not None:
        lines.append(f"floor / compute-only = {interval(floor)}, fused / floor = {interval(over_floor)} (the floor: "
                     "the faster torch GEMM of the same multiply-adds plus a copy of the other ranks' rows, no "
                     "communication: about the least a fused flow costs on ranks of one core each, on this CPU)")
    paired = ratios.get("fused_over_fused_private_paired")
    if paired is not None:
        lines.append(f"fused / fused with private outputs = {paired['estimate']:.3f} ({paired['low']:.3f}-"
                     f"{paired['high']:.3f}) (outputs in window slots where the call takes them: one-core ranks, "
                     f"outputs of 1 MiB or more, two phases)")
    if summary.get("auto_choice"):
        lines.append(f"auto ran: {summary['auto_choice']} (decided by measurement before the timed calls; fused/... "
                     f"names are the CPU engine's tile families and its gathered-inputs flow)")
    lines.extend(notes)
    return "\n".join(lines)


# fused / compute-only, the most a fused call may cost over its GEMM alone (docs/decisions/0012-benchmark-measures.md):
# fp32 1.08; bf16 and fp16, which CPUs without half-precision matrix units compute in fp32 after a conversion, 1.25.
FUSED_OVER_COMPUTE_TARGETS = {"float32": 1.08, "bfloat16": 1.25, "float16": 1.25}


# The engine's GEMM alone (its tiles, no communication) against one plain GEMM
# (docs/decisions/0014-cpu-engine-per-call-geometry.md, docs/decisions/0012-benchmark-measures.md).
ENGINE_GEMM_TARGET = 1.02


def fused_target(dtype: str) -> float:
    return FUSED_OVER_COMPUTE_TARGETS.get(str(dtype).replace("torch.", ""), 1.08)


def target_cell(paired: Optional[dict], target: float) -> str:
    """'1.071 (1.032-1.105) ok': a ratio to compute-only per iteration (metrics.paired_speedup's estimate, low and
    high) and the verdict against `target`: ok when the estimate meets it, MISS when the whole 95% interval is over
    it, else "over" (the run cannot tell it from noise)."""
    if not paired:
        return "-"
    text = f"{paired['estimate']:.3f} ({paired['low']:.3f}-{paired['high']:.3f})"
    if paired["estimate"] <= target:
        return text + " ok"
    return text + (" over" if paired["low"] <= target else " MISS")


LEGEND = """\
rows: compute only = the library's GEMM with no communication (a one-rank group), into a fresh output per call as a
  user's matmul; compute only (reused out) = the same GEMM into one output kept across calls, as fused's pooled
  outputs are (CPU, where torch's GEMM of the dtype is the library's); engine GEMM only = the fused
  engine's GEMM alone (its tiles and packed B panels for this call, no communication); all_reduce only =
  dist.all_reduce of the buffer the library reduces; sequential / chunked / fused / auto =
  torch_gemm_ar.gemm_allreduce(algorithm=); sequential (same engine) = fused's engine with its communication after
  the whole GEMM; baseline = what a user
  writes: torch.matmul + dist.all_reduce (+ bias after it) in the input dtype; baseline (fp32 compute) = the same on
  .float() inputs, shown where the library computes CPU bf16/fp16 in fp32 (CPUs without their matrix instructions).
median/min/max us: over the timed iterations, each counted from its last rank's start to its last rank's end (ranks
  of one host share a clock; across hosts, the iteration's slowest rank); min and max are single iterations.
vs base = t_baseline / t.  vs seq = t_sequential / t and saved = t_sequential - t, against the row's
  compute-then-communicate counterpart (chunked: sequential; fused: sequential on the same engine).
overlap = (t_comp + t_comm - t) / min(t_comp, t_comm) with t_comp = compute only, t_comm = t_sequential - t_comp.
GFLOP/s = 2*M*K*N / t per rank.  bus GB/s = 2*(W-1)/W * M*N * element bytes / t_comm (sequential rows: t - t_comp;
  pipelined rows and all_reduce only: t).  rel err = max|out - ref| / max|ref| against float64, worst rank.
same = every rank returned bitwise the same tensor."""


def header(title: str, device: str, world: int, threads: int) -> str:
    versions = f"torch {torch.__version__}"
    if device == "npu":
        try:
            import torch_npu

            versions += f", torch_npu {torch_npu.__version__}"
        except ImportError:
            pass
    env = dist_env.library_env()
    lines = [
        f"# {title}",
        f"command: {dist_env.typed_command()}",
        f"date: {datetime.datetime.now().isoformat(timespec='seconds')}, commit {dist_env.git_commit()}",
        f"host: {platform.node()}, {dist_env.cpu_model()}, {os.cpu_count()} cores; {versions}; device {device}, "
        f"{world} ranks, {threads} torch threads per rank",
    ]
    if env:
        lines.append("library settings: " + " ".join(env))
    return "\n".join(lines)


def header_fields(device: str, world: int, threads: int) -> Dict[str, object]:
    return {
        "command": dist_env.typed_command(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": dist_env.git_commit(),
        "host": platform.node(),
        "cpu": dist_env.cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "device": device,
        "world": world,
        "threads_per_rank": threads,
        "library_settings": dist_env.library_env(),
    }


def write_run_json(path: Optional[str], device: str, world: int, threads: int, payload: dict):
    """A run's JSON (the run's header fields first, then `payload`), and where it went; nothing without a path."""
    if not path:
        return
    write_json(path, {"run": header_fields(device, world, threads), **payload})
    print(f"\nJSON: {path}")


def write_json(path: Optional[str], payload: dict):
    if not path:
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, allow_nan=False)
    os.replace(tmp, path)  # never a half-written file next to a finished run
