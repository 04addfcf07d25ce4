"""Decode: small-M calls (a few tokens per step) of gemm_allreduce and gemm_allreduce_add_rmsnorm against what a user
writes, on real layer shapes, interleaved round-robin in one run per point, every output checked against float64 and
for the same bits on every rank first.

    torchrun --nproc-per-node 2 benchmarks/bench_decode.py [--m-list 1,4,16,64] [--layers 4096x1024,11008x1024]
        [--dtypes float32,bfloat16] [--op gemm_allreduce|add_rmsnorm|both] [--json out.json]

(`python benchmarks/bench_decode.py ...` launches the torchrun job itself.) Layers are KxN of the row-parallel GEMM
on one rank: 4096x1024 (K=4096, N=1024), and 11008x1024, a down_proj of K=11008 with its N=4096 divided by 4 to fit
the memory of a small machine (K stays real: the GEMM's pass over B is what a decode call costs).

Rows of gemm_allreduce: `a @ b` (torch's GEMM alone, no communication: compute only), `user` (a @ b, then
dist.all_reduce, then + bias), and the library's `sequential`, `fused` and `auto` (tuned before the timed calls, as
a server would with tune()). With --op add_rmsnorm: `user` is a @ b + all_reduce + residual + F.rms_norm, the
library rows gemm_allreduce_add_rmsnorm. Ratios per point: user/auto (speedup over the user's code) and
auto/(a @ b) (overhead over compute only), with their 95% intervals over the paired iterations. Targets: at
M <= 16, auto >= 1.25x the user's code and <= 1.15x compute only; at M = 64, auto >= 1.0x the user's code.
"""
import argparse
import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchkit import dist_env, metrics, report  # noqa: E402
from benchkit.inputs import make_references, make_sets  # noqa: E402
from benchkit.rows import BASELINE, COMPUTE, PIPELINED, Row  # noqa: E402
from benchkit.timing import gather_timed, time_rows  # noqa: E402

EPS = 1e-6
ALGORITHMS = ("sequential", "fused", "auto")
# (largest M, least user/auto, most auto/(a @ b)); None: no bound.
TARGETS = ((16, 1.25, 1.15), (64, 1.0, None))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--m-list", default="1,4,16,64", help="comma-separated token counts M")
    p.add_argument("--layers", default="4096x1024,11008x1024", help="comma-separated KxN (this rank's K)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16, float16")
    p.add_argument("--op", choices=("gemm_allreduce", "add_rmsnorm", "both"), default="gemm_allreduce")
    p.add_argument("--bias", action="store_true", help="add a bias vector (once, after the reduction)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per row first")
    p.add_argument("--input-sets", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write every rank's raw timings and the summary here")
    dist_env.add_launch_arguments(p, with_device=False)
    args = p.parse_args(argv)
    try:
        args.m_list = [int(v) for v in args.m_list.split(",") if v.strip()]
        args.layers = [tuple(int(v) for v in layer.lower().split("x")) for layer in args.layers.split(",") if layer]
    except ValueError:
        p.error("--m-list takes integers, --layers KxN pairs")
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if (min(args.m_list, default=0) < 1 or any(len(layer) != 2 or min(layer) < 1 for layer in args.layers)
            or any(d not in ("float32", "bfloat16", "float16") for d in args.dtypes)
            or args.iters < 1 or args.warmup < 1 or args.input_sets < 1):
        p.error("--m-list, --layers, --dtypes, --iters, --warmup or --input-sets out of range")
    return args


def epilogue_inputs(seed, count, m, n, dtype):
    """Residual and norm weight per input set: the same on every rank (the residual stream is replicated)."""
    import torch

    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(seed * 1_000_003 + 104729 * i + 17)
        out.append((torch.randn(m, n, generator=g).to(dtype), (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)))
    return out


def build_rows(env, sets, extras, op):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    lib, group = env.library, env.group
    element = sets[0].a.element_size()

    def matmul(i):
        return sets[i].a @ sets[i].b

    if op == "gemm_allreduce":
        def user(i):
            s = sets[i]
            out = s.a @ s.b
            dist.all_reduce(out, group=group)
            if s.bias is not None:
                out += s.bias
            return out

        def library(algorithm):
            return lambda i: lib.gemm_allreduce(sets[i].a, sets[i].b, group, bias=sets[i].bias, algorithm=algorithm)
    else:
        def user(i):
            s, (residual, weight) = sets[i], extras[i]
            out = s.a @ s.b
            dist.all_reduce(out, group=group)
            if s.bias is not None:
                out += s.bias
            out = out + residual
            return torch.cat([out, F.rms_norm(out, (out.shape[-1],), weight, EPS)])

        def library(algorithm):
            def run(i):
                s, (residual, weight) = sets[i], extras[i]
                out, normed = lib.gemm_allreduce_add_rmsnorm(s.a, s.b, residual, weight, group, eps=EPS, bias=s.bias,
                                                             algorithm=algorithm)
                return torch.cat([out, normed])
            return run

    rows = [Row("matmul", "a @ b (compute only)", COMPUTE, matmul, "local", element),
            Row("user", "user: a @ b + all_reduce" + (" + add + rms_norm" if op != "gemm_allreduce" else ""),
                BASELINE, user, "reduced", element)]
    rows += [Row(a, a, PIPELINED, library(a), "reduced", element) for a in ALGORITHMS]
    return rows


def references(args, env, m, k, n, dtype, op):
    """float64 results of input set 0: the local product, and the whole result (out and normed stacked)."""
    import torch

    ref = make_references(args.seed, env.world, env.rank, m, k, n, dtype, args.bias)
    if op == "gemm_allreduce":
        return ref.local, ref.reduced
    residual, weight = (t.double() for t in epilogue_inputs(args.seed, 1, m, n, dtype)[0])
    out = ref.reduced + residual
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + EPS) * weight
    return ref.local, torch.cat([out, normed])


def check(env, rows, local_ref, reduced_ref):
    """Per row: its max relative error against float64 on input set 0 and its output's digest (the same bits on
    every rank for the reduced rows)."""
    import torch

    out = {}
    for row in rows:
        got = row.run(0)
        want = local_ref if row.reference == "local" else reduced_ref
        err = metrics.relative_error(float((got.double() - want).abs().max()), float(want.abs().max()))
        digest = hashlib.sha256(got.contiguous().view(-1).view(dtype=torch.uint8).numpy()).hexdigest()
        out[row.key] = (err, digest)
    return out


def measure(env, args, m, k, n, dtype_name, op):
    import torch

    dtype = getattr(torch, dtype_name)
    sets = make_sets(args.seed, args.input_sets, env.rank, m, k, n, dtype, args.bias, env.device)
    extras = epilogue_inputs(args.seed, args.input_sets, m, n, dtype) if op != "gemm_allreduce" else None
    rows = build_rows(env, sets, extras, op)
    # auto decides its bucket before the timed calls (tune() for gemm_allreduce; the add+RMSNorm op's own bucket by
    # its first calls, as many as it takes on every rank alike).
    if op == "gemm_allreduce":
        env.library.tune([(m, k, n)], env.group, dtype, bias=args.bias)
    else:
        auto_row = rows[-1]
        env.library.tuning.warm_up_until_tuned(lambda: auto_row.run(0), 1, env.group)
    checks = check(env, rows, *references(args, env, m, k, n, dtype, op))
    local = time_rows(env, rows, args.input_sets, args.warmup - 1, args.iters)
    every_rank, one_clock = gather_timed(env, (local, checks))
    result = {"shape": {"op": op, "m": m, "k": k, "n": n, "dtype": dtype_name, "bias": args.bias}, "rows": {}}
    for row in rows:
        stamps = [times[row.key] for times, _ in every_rank]
        digests = {c[row.key][1] for _, c in every_rank}
        result["rows"][row.key] = {"label": row.label, **metrics.row_stats(stamps, one_clock),
                                   "max_rel_error": max(c[row.key][0] for _, c in every_rank),
                                   "identical_on_all_ranks": len(digests) == 1 if row.reference != "local" else None}
    if op == "gemm_allreduce":
        result["auto_ran"] = env.library.tuning.decision_for(m, k, n, dtype, bias=args.bias, group=env.group)
    else:
        scalar = {"float32": "Float", "bfloat16": "BFloat16", "float16": "Half"}[dtype_name]  # c10's names
        bucket = f"op=3;world={env.world};m<={1 << (m - 1).bit_length()};k={k};n={n};dtype={scalar}"
        result["auto_ran"] = next((d["algorithm"] for d in reversed(env.library.tuning.decisions())
                                   if d["bucket"].startswith(bucket)), None)
    iters = {key: entry["iteration_s"] for key, entry in result["rows"].items()}
    result["user_over_auto"] = metrics.paired_speedup(iters["user"], iters["auto"])
    result["auto_over_matmul"] = metrics.paired_speedup(iters["auto"], iters["matmul"])
    for key in ("user_over_auto", "auto_over_matmul"):
        result[key] = {name: result[key][name] for name in ("estimate", "low", "high")}
    result["targets"] = target_verdicts(m, result)
    return result


def target_verdicts(m, result):
    """The targets that apply at this M, each 'ok' (the estimate meets it) or 'MISS'."""
    for largest, least_speedup, most_overhead in TARGETS:
        if m <= largest:
            verdicts = {"user/auto >= %.2f" % least_speedup:
                        "ok" if result["user_over_auto"]["estimate"] >= least_speedup else "MISS"}
            if most_overhead is not None:
                verdicts["auto/(a @ b) <= %.2f" % most_overhead] = (
                    "ok" if result["auto_over_matmul"]["estimate"] <= most_overhead else "MISS")
            return verdicts
    return {}


def summary_table(results) -> str:
    headers = ["op", "layer", "dtype", "M", "a @ b us", "user us", *(f"{a} us" for a in ALGORITHMS), "auto ran",
               "user/auto (95%)", "auto/(a @ b) (95%)", "targets", "same", "rel err"]
    body = []
    for r in results:
        rows, shape = r["rows"], r["shape"]
        same = all(e["identical_on_all_ranks"] for e in rows.values() if e["identical_on_all_ranks"] is not None)
        body.append([shape["op"], f"K{shape['k']} N{shape['n']}", shape["dtype"], str(shape["m"]),
                     *(f"{rows[key]['median_s'] * 1e6:,.0f}" for key in ("matmul", "user", *ALGORITHMS)),
                     str(r["auto_ran"] or "-"), report.interval(r["user_over_auto"]),
                     report.interval(r["auto_over_matmul"]),
                     " ".join(v for v in r["targets"].values()) or "-", "yes" if same else "NO",
                     f"{max(e['max_rel_error'] for e in rows.values()):.1e}"])
    return report.format_table(headers, body, right_from=4)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not dist_env.under_torchrun():
        return dist_env.relaunch_under_torchrun(args.nproc, args.timeout_s * 20)
    env = dist_env.start("cpu", args.threads, args.timeout_s)
    ops = ("gemm_allreduce", "add_rmsnorm") if args.op == "both" else (args.op,)
    try:
        results = [measure(env, args, m, k, n, dtype, op) for op in ops for k, n in args.layers
                   for dtype in args.dtypes for m in args.m_list]
        if env.rank == 0:
            print(report.header("torch-gemm-ar: decode (small M)", "cpu", env.world, env.threads))
            print(f"median of {args.iters} interleaved calls per row, each from its last rank's start to its last "
                  f"rank's end; ratios: the median of the paired iterations' ratios with a 95% interval")
            print()
            print(summary_table(results))
            print()
            print("targets: " + "; ".join(
                f"M <= {largest}: user/auto >= {speedup}" + (f", auto/(a @ b) <= {overhead}" if overhead else "")
                for largest, speedup, overhead in TARGETS) + " (ok/MISS by the estimate, in the order shown)")
            report.write_run_json(args.json, "cpu", env.world, env.threads, {"shapes": results})
    finally:
        dist_env.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
