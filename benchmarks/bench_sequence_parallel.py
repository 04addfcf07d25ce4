"""The sequence-parallel pair on the CPU fused engine against the library's own sequential algorithm, the GEMM alone
and what a user writes: matmul + dist.reduce_scatter_tensor (GEMM+RS), dist.all_gather_into_tensor + matmul
(AG+GEMM). All rows of both ops interleaved round-robin on rotated input sets in one run; every output checked
against float64 first.

    torchrun --nproc-per-node 2 benchmarks/bench_sequence_parallel.py [--shapes 4096x256x2048] [--dtype fp32|bf16]

M is the whole sequence: gemm_reduce_scatter's input rows (each rank gets M / world output rows), allgather_gemm's
gathered rows (each rank holds M / world). Targets on the CPU engine, 2 ranks, M4096 K256 N2048 fp32:
GEMM+RS fused / compute-only <= 1.08, AG+GEMM fused / compute-only <= 1.10.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchkit import dist_env, metrics, report  # noqa: E402
from benchkit.inputs import make_sets  # noqa: E402
from benchkit.rows import COMPUTE, PIPELINED, SEQUENTIAL, BASELINE, Row  # noqa: E402
from benchkit.timing import gather_timed, time_rows  # noqa: E402
from bench_cpu_fused import parse_shapes  # noqa: E402

DEFAULT_SHAPES = "4096x256x2048,512x256x2048"
TARGETS = {"gemm_reduce_scatter": 1.08, "allgather_gemm": 1.10}
# Row keys per op, in table order, and what each one times.
ROW_LABELS = {
    "compute_only": "a @ b alone (the whole M x K x N GEMM, no communication)",
    "user": "what a user writes",
    "sequential": "library, algorithm='sequential'",
    "fused": "library, algorithm='fused'",
}
USER_LABELS = {"gemm_reduce_scatter": "matmul + dist.reduce_scatter_tensor",
               "allgather_gemm": "dist.all_gather_into_tensor + matmul"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated MxKxN (M: the whole sequence)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--input-sets", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    dist_env.add_launch_arguments(p, with_device=False)
    return p.parse_args(argv)


def op_inputs(args, env, m, k, n, dtype):
    """Per input set: gemm_reduce_scatter's [M, K] and allgather_gemm's [M / world, K] (the first rows of the same
    draw), each rank's own; the weight is shared. Also every rank's, for the float64 references of set 0."""
    every = [make_sets(args.seed, args.input_sets, r, m, k, n, dtype, False, "cpu") for r in range(env.world)]
    return every[env.rank], every


def build_rows(env, sets, m, n):
    import warnings

    import torch
    import torch.distributed as dist

    # torch 2.13 suggests *_single for the *_tensor collectives on every call; they are still what users write.
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*_tensor` is deprecated")

    lib, group, world = env.library, env.group, env.world
    rows_per_rank = m // world
    gathered_for_compute = [torch.cat([s.a[:rows_per_rank]] * world) for s in sets]  # M rows, as after the gather

    def rs_compute(i):
        return sets[i].a @ sets[i].b

    def rs_user(i):
        full = sets[i].a @ sets[i].b
        chunk = torch.empty(rows_per_rank, n, dtype=full.dtype)
        dist.reduce_scatter_tensor(chunk, full, group=group)
        return chunk

    def rs_lib(algorithm):
        return lambda i: lib.gemm_reduce_scatter(sets[i].a, sets[i].b, group, algorithm=algorithm)

    def ag_compute(i):
        return gathered_for_compute[i] @ sets[i].b

    def ag_user(i):
        shard = sets[i].a[:rows_per_rank]
        gathered = torch.empty(m, shard.shape[1], dtype=shard.dtype)
        dist.all_gather_into_tensor(gathered, shard, group=group)
        return gathered @ sets[i].b

    def ag_lib(algorithm):
        return lambda i: lib.allgather_gemm(sets[i].a[:rows_per_rank], sets[i].b, group, algorithm=algorithm)

    element = torch.empty(0, dtype=sets[0].a.dtype).element_size()
    rows = {}
    for op, compute, user, library in (("gemm_reduce_scatter", rs_compute, rs_user, rs_lib),
                                       ("allgather_gemm", ag_compute, ag_user, ag_lib)):
        rows[op] = [Row(f"{op}/compute_only", ROW_LABELS["compute_only"], COMPUTE, compute, "local", element),
                    Row(f"{op}/user", USER_LABELS[op], BASELINE, user, "reduced", element),
                    Row(f"{op}/sequential", ROW_LABELS["sequential"], SEQUENTIAL, library("sequential"), "reduced",
                        element),
                    Row(f"{op}/fused", ROW_LABELS["fused"], PIPELINED, library("fused"), "reduced", element)]
    return rows


def references(every, rank, world, m):
    """float64 results of input set 0: this rank's reduce-scatter chunk, and the gathered product."""
    import torch

    b = every[0][0].b.double()
    rows_per_rank = m // world
    reduced = sum(sets[0].a.double() @ b for sets in every)
    gathered = torch.cat([sets[0].a[:rows_per_rank].double() for sets in every])
    return {"gemm_reduce_scatter": reduced[rank * rows_per_rank:(rank + 1) * rows_per_rank],
            "allgather_gemm": gathered @ b}


def check(rows, refs):
    """Max relative error of every library and user row on input set 0 against float64 (compute only is not the
    op's result and is not checked)."""
    errors = {}
    for op, op_rows in rows.items():
        want = refs[op]
        for row in op_rows:
            if row.key.endswith("compute_only"):
                continue
            got = row.run(0).double()
            assert got.shape == want.shape, f"{row.key}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
            errors[row.key] = metrics.relative_error(float((got - want).abs().max()), float(want.abs().max()))
    return errors


def measure(env, shape, dtype, args):
    m, k, n = shape
    if m % env.world:
        raise SystemExit(f"--shapes: M={m} must be divisible by the world size {env.world} (M is the whole sequence)")
    sets, every = op_inputs(args, env, m, k, n, dtype)
    rows = build_rows(env, sets, m, n)
    errors = check(rows, references(every, env.rank, env.world, m))
    flat = [row for op_rows in rows.values() for row in op_rows]
    local = time_rows(env, flat, args.input_sets, max(args.warmup - 1, 0), args.iters)
    every_rank, one_clock = gather_timed(env, (local, errors))
    result = {"shape": {"m": m, "k": k, "n": n, "dtype": args.dtype}, "ops": {}}
    for op, op_rows in rows.items():
        entries = {}
        for row in op_rows:
            stamps = [times[row.key] for times, _ in every_rank]
            entry = {"label": row.label, **metrics.row_stats(stamps, one_clock)}
            if row.key in errors:
                entry["max_rel_error"] = max(errs[row.key] for _, errs in every_rank)
            entries[row.key.split("/")[1]] = entry
        med = {key: e["median_s"] for key, e in entries.items()}
        result["ops"][op] = {"rows": entries, "target_fused_over_compute_only": TARGETS[op], "ratios": {
            "fused_over_compute_only": med["fused"] / med["compute_only"],
            "fused_over_user": med["fused"] / med["user"],
            "sequential_over_compute_only": med["sequential"] / med["compute_only"],
            "user_over_compute_only": med["user"] / med["compute_only"]}}
    return result


def summary_table(results) -> str:
    headers = ["op", "shape", "compute us", "user us", "sequential us", "fused us", "fused/compute", "fused/user",
               "seq/compute", "rel err (fused)"]
    body = []
    for r in results:
        s = r["shape"]
        for op, entry in r["ops"].items():
            rows, ratios = entry["rows"], entry["ratios"]
            ratio = ratios["fused_over_compute_only"]
            body.append([op, f"M{s['m']} K{s['k']} N{s['n']} {s['dtype']}",
                         *(f"{rows[key]['median_s'] * 1e6:,.1f}" for key in ("compute_only", "user", "sequential",
                                                                           "fused")),
                         f"{ratio:.3f}" + (" ok" if ratio <= entry["target_fused_over_compute_only"] else " MISS"),
                         f"{ratios['fused_over_user']:.3f}", f"{ratios['sequential_over_compute_only']:.3f}",
                         f"{rows['fused']['max_rel_error']:.1e}"])
    return report.format_table(headers, body, right_from=2)


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
            print(report.header("torch-gemm-ar: sequence parallelism (GEMM+RS, AG+GEMM)", "cpu", env.world,
                                env.threads))
            print(f"median of {args.iters} interleaved calls, each from its last rank's start to its last rank's end; "
                  f"targets fused/compute: {', '.join(f'{op} <= {t}' for op, t in TARGETS.items())}")
            print(summary_table(results))
            report.write_run_json(args.json, "cpu", env.world, env.threads, {"targets": TARGETS, "shapes": results})
    finally:
        dist_env.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
