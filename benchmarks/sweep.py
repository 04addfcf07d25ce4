"""Sweep of the row-parallel layers of tensor-parallel Llama-style models (o_proj, down_proj; hidden 2048-8192,
TP 2-8) over the number of tokens M, every algorithm against the torch baseline.

    python benchmarks/sweep.py --out DIR [--quick]        (launches 2 ranks with torchrun itself)
    torchrun --nproc-per-node 2 benchmarks/sweep.py --out DIR [--quick]

Writes DIR/sweep.json (every point, raw timings included) and DIR/sweep.png (speedup over the baseline vs M, one
panel per layer), prints a table per layer, where each overlapping algorithm starts to beat `sequential` (the
measurement behind the `auto` thresholds), and per point `auto` against the baseline (floor 0.98x) and against the
best single algorithm there (floor 0.97x), with the worst point of each.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchkit import crossover, dist_env, models, plot, report  # noqa: E402
from benchkit.measure import Settings, Shape, measure_shape  # noqa: E402
from benchkit.progress import Progress  # noqa: E402
from benchkit.rows import available_row_keys  # noqa: E402

FULL_MS = "1,4,16,64,128,256,512,1024,2048,4096,8192"
QUICK_MS = "1,16,128,512,2048"
QUICK_MODELS = "Llama-3.2-1B,Llama-3.1-8B"
QUICK_TP = "2,8"
SWEPT_ROWS = ("sequential", "chunked", "fused", "auto", "baseline", "baseline_fp32", "npu_mm_all_reduce_base")


def int_list(text: str):
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="directory for sweep.json and sweep.png")
    p.add_argument("--quick", action="store_true",
                   help=f"models {QUICK_MODELS}, TP {QUICK_TP}, M {QUICK_MS}, short timing: a few minutes on 2 CPUs")
    p.add_argument("--models", help=f"comma-separated, from {', '.join(models.MODELS)} (default: all; quick: "
                                    f"{QUICK_MODELS})")
    p.add_argument("--tp", help="comma-separated tensor-parallel degrees (default 2,4,8; quick: 2,8)")
    p.add_argument("--m-list", help=f"comma-separated token counts (default {FULL_MS}; quick: {QUICK_MS})")
    p.add_argument("--scale", type=int, default=None,
                   help="divide N (output columns) by this to fit the machine (default: cpu 8, npu 1); K stays the "
                        "layer's real one, so compute-heavy layers keep their flops per output element")
    p.add_argument("--k-scale", type=int, default=1,
                   help="also divide K by this (changes the compute/communication balance; for tiny test runs)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="default: float32 on cpu, float16 on npu")
    p.add_argument("--budget-s", type=float, default=None,
                   help="timing budget per point after warm-up (default 4.0)")
    p.add_argument("--min-iters", type=int, default=9, help="timed iterations per point at least")
    p.add_argument("--max-iters", type=int, default=100, help="timed iterations per point at most")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the float64 reference (saves time at large M)")
    dist_env.add_launch_arguments(
        p, timeout_help="bound of every collective wait (the whole run is bounded by 50x this when self-launched)")
    args = p.parse_args(argv)
    args.models = (args.models or (QUICK_MODELS if args.quick else ",".join(models.MODELS))).split(",")
    args.tp = int_list(args.tp or (QUICK_TP if args.quick else "2,4,8"))
    args.m_list = int_list(args.m_list or (QUICK_MS if args.quick else FULL_MS))
    args.scale = args.scale or (8 if args.device == "cpu" else 1)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "float16")
    args.budget_s = args.budget_s if args.budget_s is not None else 4.0
    args.min_iters = min(args.min_iters, args.max_iters)
    if min(args.m_list, default=0) < 1 or min(args.tp) < 1 or args.scale < 1 or args.k_scale < 1:
        p.error("--m-list, --tp, --scale and --k-scale take positive integers")
    return args


def layer_table(name, ms, points, analysis) -> str:
    keys = [k for k in SWEPT_ROWS if k != "baseline" and any(k in p["rows"] for p in points)]
    headers = ["M", "baseline us", *[f"{k} x" for k in keys], "best", "auto ran", "auto/best x (95%)"]
    vs_best_at = {r["m"]: r for r in analysis["auto_vs_best"] if r["layer"] == name}
    body = []
    for m, point in zip(ms, points):
        base = point["rows"]["baseline"]
        cells = [str(m), f"{base['median_s'] * 1e6:,.1f}" if base.get("available") else "-"]
        for k in keys:
            e = point["rows"].get(k, {})
            cells.append(f"{e['speedup_vs_baseline']:.3f}" if e.get("speedup_vs_baseline") is not None else
                         ("absent" if not e.get("available") else "-"))
        best = crossover.best_algorithm(point)
        cells.append(best or "-")
        cells.append(point.get("auto_choice") or "-")
        vs_best = vs_best_at.get(m)  # analyse() compared auto with the best row already
        cells.append(f"{vs_best['speed_vs_best']:.3f} ({vs_best['interval'][0]:.2f}-{vs_best['interval'][1]:.2f})"
                     if vs_best else "-")
        body.append(cells)
    return report.format_table(headers, body)


def conclusions(analysis: dict) -> str:
    lines = ["Where auto should switch (smallest M from which the algorithm beats sequential at every larger M):"]
    for name, c in analysis["crossovers"].items():
        lines.append(f"  {name}: " + ", ".join(f"{k} from M={v}" if v is not None else f"{k} never"
                                             for k, v in c.items()))
    rec = analysis["recommended_thresholds"]
    lines.append("Recommended (every layer): " + ", ".join(
        f"{k} = {v}" if v is not None else f"{k} = none (some layer never gains)" for k, v in rec.items()))
    for what, worst_key, speed_key, floor_key, below_key, noise_key in (
            ("baseline", "auto_worst", "speed_vs_baseline", "auto_floor", "auto_below_floor",
             "auto_under_floor_within_noise"),
            ("best single algorithm", "auto_worst_vs_best", "speed_vs_best", "auto_best_floor",
             "auto_below_best_floor", "auto_under_best_floor_within_noise")):
        worst = analysis[worst_key]
        if worst is None:
            lines.append(f"auto vs {what}: not measured")
            continue
        floor = analysis[floor_key]

        def where(r):
            of = f" of {r['best']}" if "best" in r else ""
            return (f"{r['layer']} M={r['m']} ({r[speed_key]:.3f}x{of}, 95% {r['interval'][0]:.2f}-"
                    f"{r['interval'][1]:.2f}, auto ran {r['auto_choice'] or '?'})")

        below, noise = analysis[below_key], analysis[noise_key]
        verdict = "OK" if not below else f"BELOW {floor}x at {len(below)} point(s): " + ", ".join(map(where, below))
        lines.append(f"auto vs {what}: worst {where(worst)}; floor {floor}x (the whole 95% interval under it): "
                     f"{verdict}")
        if noise:
            lines.append(f"  under {floor}x by the estimate only, the interval reaching it, at {len(noise)} "
                         f"point(s): " + ", ".join(map(where, noise)))
    if analysis.get("auto_vs_best"):
        family = analysis.get("auto_chose_best_family", 0)
        lines.append(f"auto ran the best single algorithm at {analysis['auto_chose_best']} of "
                     f"{len(analysis['auto_vs_best'])} points" +
                     (f", and it as another of the CPU engine's configurations (fused/tiles, fused/few-products or "
                      f"fused/gathered-inputs, measured faster while tuning) at {family} more" if family else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not dist_env.under_torchrun():
        return dist_env.relaunch_under_torchrun(args.nproc, args.timeout_s * 50)
    import torch

    dtype = getattr(torch, args.dtype)
    sweep_layers = models.layers(args.models, args.tp, args.scale, args.k_scale)
    env = dist_env.start(args.device, args.threads, args.timeout_s)
    try:
        keys = [k for k in available_row_keys(args.device, dtype) if k in SWEPT_ROWS]
        settings = Settings(seed=args.seed, warmup=args.warmup, iters=None, budget_s=args.budget_s,
                            min_iters=args.min_iters, max_iters=args.max_iters, check=not args.no_check)
        progress = Progress(len(sweep_layers) * len(args.m_list), enabled=env.rank == 0)
        points_by_layer = []
        for layer in sweep_layers:
            points = []
            for m in args.m_list:
                points.append(measure_shape(env, Shape(m, layer.k, layer.n, dtype), keys, settings))
                progress.step(f"{layer.name} M={m}")
            points_by_layer.append(points)
        if env.rank == 0:
            names = [layer.name for layer in sweep_layers]
            analysis = crossover.analyse(names, args.m_list, points_by_layer)
            os.makedirs(args.out, exist_ok=True)
            title = f"torch-gemm-ar sweep: {args.dtype}, {env.world} ranks on {args.device}"
            print(report.header(title, args.device, env.world, env.threads))
            for name, points in zip(names, points_by_layer):
                print(f"\n{name}: speedup over the torch baseline (x) per algorithm")
                print(layer_table(name, args.m_list, points, analysis))
            print()
            print(conclusions(analysis))
            png = os.path.join(args.out, "sweep.png")
            missing = plot.matplotlib_missing()
            if missing is None:
                plot.speedup_plot(png, title, names, args.m_list, points_by_layer, crossover.AUTO_FLOOR)
                print(f"\nplot: {png}")
            else:
                png = None
                print(f"\nplot: not written: {missing}")
            json_path = os.path.join(args.out, "sweep.json")
            report.write_run_json(json_path, args.device, env.world, env.threads, {
                "dtype": args.dtype, "scale": args.scale, "k_scale": args.k_scale, "m_list": args.m_list,
                "layers": [{"name": layer.name, "model": layer.model, "projection": layer.projection, "tp": layer.tp,
                            "k": layer.k, "n": layer.n, "points": pts}
                           for layer, pts in zip(sweep_layers, points_by_layer)],
                "analysis": analysis,
                "plot": png, "plot_missing_reason": missing,
            })
    finally:
        dist_env.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
