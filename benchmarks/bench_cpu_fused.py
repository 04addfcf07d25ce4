"""The CPU fused engine against its own sequential mode, the GEMM alone and the torch baseline, on three shapes
from communication-heavy to compute-heavy (fp32, 2 ranks by default), in the terms of pto-isa's gemm_ar example
(docs/decisions/0012-benchmark-measures.md).

    torchrun --nproc-per-node 2 benchmarks/bench_cpu_fused.py -- [--json out.json]

The targets: the engine's GEMM alone (its tiles, no communication) <= 1.02x compute-only, and fused / compute-only
<= 1.08 (the communication almost entirely hidden under the GEMM).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchkit import dist_env, report  # noqa: E402
from benchkit.measure import Settings, Shape, measure_shape  # noqa: E402
from benchkit.rows import available_row_keys  # noqa: E402

DEFAULT_SHAPES = "4096x256x2048,2048x1024x1024,1024x4096x1024"
ROWS = ["compute_only", "compute_reused", "engine_gemm", "traffic_floor", "fused_sequential", "fused", "fused_private",
        "baseline"]
TARGET_RATIO = report.fused_target("float32")
ENGINE_GEMM_TARGET = report.ENGINE_GEMM_TARGET


def parse_shapes(text: str):
    shapes = []
    for item in text.split(","):
        try:
            m, k, n = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--shapes: expected MxKxN items separated by commas; got {item!r}")
        shapes.append((m, k, n))
    return shapes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated MxKxN")
    # 30: enough for per-iteration ratios with 95% intervals of a few percent; 10 leave them too wide to judge.
    p.add_argument("--iters", type=int, default=30, help="timed iterations per row")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--input-sets", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    dist_env.add_launch_arguments(p, with_device=False)
    return p.parse_args(argv)


def summary_table(results) -> str:
    headers = ["shape", "compute us", "engine GEMM us", "sequential us", "fused us", "baseline us", "speedup",
               "overlap eff", "engine GEMM/compute", "fused/compute", "fused/compute (reused out)", "floor/compute",
               "vs baseline"]
    body = []
    for r in results:
        rows, s = r["rows"], r["shape"]

        def us(key):
            e = rows.get(key, {})
            return f"{e['median_s'] * 1e6:,.1f}" if e.get("available") else "absent"

        fused = rows.get("fused", {})
        body.append([
            f"M{s['m']} K{s['k']} N{s['n']}", us("compute_only"), us("engine_gemm"), us("fused_sequential"), us("fused"),
            us("baseline"),
            f"{fused['speedup_vs_sequential']:.3f}x" if fused.get("speedup_vs_sequential") else "-",
            f"{fused['overlap_efficiency'] * 100:.1f}%" if fused.get("overlap_efficiency") is not None else "-",
            report.target_cell(r["ratios"].get("engine_gemm_over_compute_only_paired"), ENGINE_GEMM_TARGET),
            report.target_cell(r["ratios"].get("fused_over_compute_only_paired"), TARGET_RATIO),
            report.target_cell(r["ratios"].get("fused_over_compute_reused_paired"), TARGET_RATIO),
            report.interval(r["ratios"]["traffic_floor_over_compute_only_paired"])
            if r["ratios"].get("traffic_floor_over_compute_only_paired") else "-",
            f"{fused['speedup_vs_baseline']:.3f}x" if fused.get("speedup_vs_baseline") else "-",
        ])
    return report.format_table(headers, body)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not dist_env.under_torchrun():
        return dist_env.relaunch_under_torchrun(args.nproc, args.timeout_s)
    import torch

    env = dist_env.start("cpu", args.threads, args.timeout_s)
    try:
        settings = Settings(seed=args.seed, input_sets=args.input_sets, warmup=args.warmup, iters=args.iters)
        available = available_row_keys("cpu", torch.float32)
        rows = [key for key in ROWS if key in available]  # fused_private only with TORCH_GEMM_AR_SHARED_OUTPUTS
        results = [measure_shape(env, Shape(m, k, n, torch.float32), rows, settings)
                   for m, k, n in parse_shapes(args.shapes)]
        if env.rank == 0:
            print(report.header("torch-gemm-ar: CPU fused engine", "cpu", env.world, env.threads))
            for r in results:
                print()
                print(report.shape_table(r))
            print()
            print(f"Summary (fused against the same engine's sequential mode; targets engine GEMM/compute <= "
                  f"{ENGINE_GEMM_TARGET}, fused/compute <= {TARGET_RATIO};\n ratios per iteration, in brackets their 95% "
                  f"interval; ok = meets the target, MISS = the whole interval is over it, over = over it by the "
                  f"estimate only;\n floor = the faster torch GEMM of the same multiply-adds plus a copy of the other "
                  f"ranks' rows, no communication: about the least a fused flow costs on ranks of one core each)")
            print(summary_table(results))
            print()
            print(report.LEGEND)
            report.write_run_json(args.json, "cpu", env.world, env.threads,
                                  {"target_fused_over_compute_only": TARGET_RATIO,
                                   "target_engine_gemm_over_compute_only": ENGINE_GEMM_TARGET, "shapes": results})
    finally:
        dist_env.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
