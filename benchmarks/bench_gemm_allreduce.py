"""GEMM + AllReduce, every algorithm side by side on the same inputs in one run, reported in the terms of
pto-isa's gemm_ar example (docs/decisions/0012-benchmark-measures.md).

    torchrun --nproc-per-node 2 benchmarks/bench_gemm_allreduce.py [--M 4096 --K 128 --N 2048] [--json out.json]

(`python benchmarks/bench_gemm_allreduce.py ...` launches the torchrun job itself, --nproc ranks. The shape options
are spelled --M/--K/--N: torchrun's parser reads a lowercase --m or --n as an ambiguous abbreviation of its own
options and stops, even as --m=4096; --m/--k/--n still work without torchrun or after a "--".) Rows: compute
only, all_reduce only, sequential, chunked, sequential on the fused engine, fused, auto, the user's baseline
(torch.matmul + dist.all_reduce), on CPU half dtypes also that baseline computed in fp32, on NPU also
torch_npu.npu_mm_all_reduce_base. Rank 0 prints one table; --json saves every rank's raw timings and the summary.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchkit import dist_env, report  # noqa: E402
from benchkit.measure import Settings, Shape, measure_shape  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")
# Which rows every run measures whatever --algorithms says: the references the derived numbers need.
ALWAYS = ("compute_only", "baseline", "baseline_fp32")
# A row that is only meaningful next to another one.
COMPANIONS = {"fused": ("fused_sequential", "compute_reused", "traffic_floor"), "chunked": ("sequential",)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # Default: a communication-heavy shape for a CPU (2*K = 256 flops per 4-byte output element: the GEMM and
    # gloo's all_reduce take about as long) that runs in well under a minute on 2 CPU ranks.
    # Uppercase first: the spelling torchrun passes through (see the module docstring); lowercase kept as aliases.
    p.add_argument("--M", "--m", dest="m", type=int, default=4096, help="rows of a (tokens)")
    p.add_argument("--K", "--k", dest="k", type=int, default=128,
                   help="inner dimension (this rank's shard of the hidden size)")
    p.add_argument("--N", "--n", dest="n", type=int, default=2048, help="output columns")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default: float32 on cpu, float16 on npu")
    p.add_argument("--bias", action="store_true", help="add a bias vector (once, after the reduction)")
    p.add_argument("--algorithms", default="all",
                   help="comma-separated rows to measure besides compute_only and the baselines: "
                        "allreduce_only, sequential, chunked, fused, auto (npu: npu_mm_all_reduce_base), or all")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per row first")
    p.add_argument("--input-sets", type=int, default=3, help="independent random input sets, rotated per iteration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write every rank's raw timings and the summary here")
    dist_env.add_launch_arguments(
        p, timeout_help="bound of every collective wait, and of the whole run when this script launches torchrun")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float16" if args.device == "npu" else "float32")
    if min(args.m, args.k, args.n) < 1 or args.iters < 1 or args.warmup < 0 or args.input_sets < 1:
        p.error("--M/--K/--N/--iters/--input-sets must be >= 1 and --warmup >= 0")
    return args


def selected_rows(requested: str, device: str, dtype) -> list:
    from benchkit.rows import available_row_keys

    possible = available_row_keys(device, dtype)
    if requested == "all":
        return possible
    wanted = {name.strip() for name in requested.split(",") if name.strip()}
    unknown = wanted - set(possible)
    if unknown:
        raise SystemExit(f"--algorithms: unknown or not applicable here: {sorted(unknown)}; choose from {possible}")
    for name in list(wanted):
        wanted.update(COMPANIONS.get(name, ()))
    wanted.update(k for k in ALWAYS if k in possible)
    return [k for k in possible if k in wanted]


def main(argv=None) -> int:
    args = parse_args(argv)
    if not dist_env.under_torchrun():
        return dist_env.relaunch_under_torchrun(args.nproc, args.timeout_s)
    import torch

    dtype = getattr(torch, args.dtype)
    env = dist_env.start(args.device, args.threads, args.timeout_s)
    try:
        shape = Shape(args.m, args.k, args.n, dtype, args.bias)
        settings = Settings(seed=args.seed, input_sets=args.input_sets, warmup=args.warmup, iters=args.iters)
        summary = measure_shape(env, shape, selected_rows(args.algorithms, args.device, dtype), settings)
        if env.rank == 0:
            print(report.header("torch-gemm-ar: GEMM + AllReduce", args.device, env.world, env.threads))
            print()
            print(report.shape_table(summary))
            print()
            print(report.LEGEND)
            report.write_run_json(args.json, args.device, env.world, env.threads, summary)
    finally:
        dist_env.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
