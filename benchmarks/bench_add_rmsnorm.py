"""The fused add+RMSNorm epilogue (gemm_allreduce_add_rmsnorm) against gemm_allreduce alone and against what a user
writes: gemm_allreduce, then torch's add and torch.nn.functional.rms_norm. Interleaved round-robin on rotated input
sets, both outputs checked against float64 first.

    torchrun --nproc-per-node 2 benchmarks/bench_add_rmsnorm.py [--shapes 4096x256x2048,64x256x2048] [--dtype fp32|bf16]

Target on the CPU engine: fused epilogue / gemm_allreduce alone <= 1.03 at M4096 K256 N2048.

The "floor" row is gemm_allreduce followed by one copy of `residual` into a buffer of normed's size: the memory
traffic no out-of-place epilogue can avoid (read residual, write normed), as a separate pass after the call. The
fused epilogue does that traffic inside the call, stripe by stripe, and can come in below it.

The in-place variant (gemm_allreduce_add_rmsnorm_) writes the new residual stream into `residual`: the reduction
adds into it, so reading `residual` replaces the read-for-ownership of a separate output, and what is left over
gemm_allreduce alone is writing `normed`. Its floor row is gemm_allreduce followed by filling a buffer of normed's
size. Each in-place row has its own residual buffers (they grow by the sum on every call; the cost does not change).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchkit import dist_env, metrics, report  # noqa: E402
from benchkit.inputs import make_references, make_sets  # noqa: E402
from benchkit.rows import PIPELINED, Row  # noqa: E402
from benchkit.timing import gather_timed, time_rows  # noqa: E402
from bench_cpu_fused import parse_shapes  # noqa: E402

DEFAULT_SHAPES = "4096x256x2048,64x256x2048,1x256x2048"
TARGET_RATIO = 1.03
EPS = 1e-6


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated MxKxN")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--algorithm", default="fused", help="the algorithm of every library row")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--input-sets", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    dist_env.add_launch_arguments(p, with_device=False)
    return p.parse_args(argv)


def epilogue_inputs(seed, count, m, n, dtype):
    """Residual and norm weight per input set: the same on every rank (the residual stream is replicated)."""
    import torch

    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(seed * 1_000_003 + 104729 * i + 17)
        out.append((torch.randn(m, n, generator=g).to(dtype), (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)))
    return out


def build_rows(env, sets, extras, algorithm):
    import torch
    import torch.nn.functional as F

    lib = env.library

    def alone(i):
        return lib.gemm_allreduce(sets[i].a, sets[i].b, env.group, algorithm=algorithm)

    def unfused(i):
        residual, weight = extras[i]
        out = lib.gemm_allreduce(sets[i].a, sets[i].b, env.group, algorithm=algorithm) + residual
        return out, F.rms_norm(out, (out.shape[-1],), weight, EPS)

    def fused(i):
        residual, weight = extras[i]
        return lib.gemm_allreduce_add_rmsnorm(sets[i].a, sets[i].b, residual, weight, env.group, eps=EPS,
                                              algorithm=algorithm)

    normed_sized = [torch.empty_like(residual) for residual, _ in extras]

    def floor(i):
        out = lib.gemm_allreduce(sets[i].a, sets[i].b, env.group, algorithm=algorithm)
        normed_sized[i].copy_(extras[i][0])
        return out

    in_place_residuals = [residual.clone() for residual, _ in extras]

    def fused_in_place(i):
        normed = lib.gemm_allreduce_add_rmsnorm_(sets[i].a, sets[i].b, in_place_residuals[i], extras[i][1], env.group,
                                                 eps=EPS, algorithm=algorithm)
        return in_place_residuals[i], normed

    def floor_in_place(i):
        out = lib.gemm_allreduce(sets[i].a, sets[i].b, env.group, algorithm=algorithm)
        normed_sized[i].fill_(0)
        return out

    element = torch.empty(0, dtype=sets[0].a.dtype).element_size()
    return [Row("gemm_allreduce", "gemm_allreduce alone", PIPELINED, alone, "reduced", element),
            Row("floor", "gemm_allreduce + copy residual (the epilogue's traffic)", PIPELINED, floor, "reduced",
                element),
            Row("unfused", "gemm_allreduce + add + F.rms_norm", PIPELINED, unfused, "reduced", element),
            Row("fused_epilogue", "gemm_allreduce_add_rmsnorm", PIPELINED, fused, "reduced", element),
            Row("floor_in_place", "gemm_allreduce + fill a normed-size buffer (the in-place epilogue's traffic)",
                PIPELINED, floor_in_place, "reduced", element),
            Row("fused_in_place", "gemm_allreduce_add_rmsnorm_ (in place)", PIPELINED, fused_in_place, "reduced",
                element)], in_place_residuals


def check(rows, reference, residual, weight, in_place_residuals):
    """Max relative error of each row's outputs on input set 0 against float64 (the in-place row on a fresh copy of
    set 0's residual)."""
    import torch

    out_ref = reference + residual.double()
    rms = torch.rsqrt(out_ref.pow(2).mean(-1, keepdim=True) + EPS)
    normed_ref = out_ref * rms * weight.double()
    errors = {}
    for row in rows:
        if row.key == "fused_in_place":
            in_place_residuals[0].copy_(residual)
        got = row.run(0)
        alone = row.key in ("gemm_allreduce", "floor", "floor_in_place")
        pairs = [(got, reference)] if alone else [(got[0], out_ref), (got[1], normed_ref)]
        errors[row.key] = max(metrics.relative_error(float((g.double() - w).abs().max()), float(w.abs().max()))
                              for g, w in pairs)
    return errors


def measure(env, shape, dtype, args):
    m, k, n = shape
    sets = make_sets(args.seed, args.input_sets, env.rank, m, k, n, dtype, False, env.device)
    extras = epilogue_inputs(args.seed, args.input_sets, m, n, dtype)
    rows, in_place_residuals = build_rows(env, sets, extras, args.algorithm)
    reference = make_references(args.seed, env.world, env.rank, m, k, n, dtype, False).reduced
    errors = check(rows, reference, *extras[0], in_place_residuals)
    local = time_rows(env, rows, args.input_sets, max(args.warmup - 1, 0), args.iters)
    every_rank, one_clock = gather_timed(env, (local, errors))
    result = {"shape": {"m": m, "k": k, "n": n, "dtype": args.dtype}, "rows": {}}
    for row in rows:
        stamps = [times[row.key] for times, _ in every_rank]
        result["rows"][row.key] = {"label": row.label, **metrics.row_stats(stamps, one_clock),
                                   "max_rel_error": max(errs[row.key] for _, errs in every_rank)}
    med = {key: entry["median_s"] for key, entry in result["rows"].items()}
    result["ratios"] = {"fused_over_alone": med["fused_epilogue"] / med["gemm_allreduce"],
                        "floor_over_alone": med["floor"] / med["gemm_allreduce"],
                        "in_place_over_alone": med["fused_in_place"] / med["gemm_allreduce"],
                        "floor_in_place_over_alone": med["floor_in_place"] / med["gemm_allreduce"],
                        "fused_over_unfused": med["fused_epilogue"] / med["unfused"]}
    return result


def summary_table(results) -> str:
    headers = ["shape", "alone us", "unfused us", "fused us", "fused/alone", "floor/alone", "in-place us",
               "in-place/alone", "in-place floor/alone", "fused/unfused", "rel err (fused, in-place)"]
    body = []
    for r in results:
        s, rows, ratios = r["shape"], r["rows"], r["ratios"]
        ratio = ratios["fused_over_alone"]
        body.append([f"M{s['m']} K{s['k']} N{s['n']} {s['dtype']}",
                     *(f"{rows[key]['median_s'] * 1e6:,.1f}" for key in ("gemm_allreduce", "unfused", "fused_epilogue")),
                     f"{ratio:.3f}" + (" ok" if ratio <= TARGET_RATIO else " MISS"),
                     f"{ratios['floor_over_alone']:.3f}", f"{rows['fused_in_place']['median_s'] * 1e6:,.1f}",
                     f"{ratios['in_place_over_alone']:.3f}" + (" ok" if ratios['in_place_over_alone'] <= TARGET_RATIO
                                                                else " MISS"),
                     f"{ratios['floor_in_place_over_alone']:.3f}", f"{ratios['fused_over_unfused']:.3f}",
                     f"{rows['fused_epilogue']['max_rel_error']:.1e}, {rows['fused_in_place']['max_rel_error']:.1e}"])
    return report.format_table(headers, body)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not dist_env.under_torchrun():
        return dist_env.relaunch_under_torchrun(args.nproc, args.timeout_s)
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    env = dist_env.start("cpu", args.threads, args.timeout_s)
    try:
        results = [measure(env, shape, dtype, args) for shape in parse_shapes(args.shapes)]
        if env.rank == 0:
            print(report.header("torch-gemm-ar: fused add+RMSNorm epilogue", "cpu", env.world, env.threads))
            print(f"algorithm={args.algorithm}; median of {args.iters} interleaved calls, each from its last rank's "
                  f"start to its last rank's end; target fused/alone <= {TARGET_RATIO}")
            print(summary_table(results))
            report.write_run_json(args.json, "cpu", env.world, env.threads,
                                  {"algorithm": args.algorithm, "target_fused_over_alone": TARGET_RATIO,
                                   "shapes": results})
    finally:
        dist_env.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
