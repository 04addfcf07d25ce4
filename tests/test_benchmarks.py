"""The benchmarks: their formulas against the published figures of pto-isa's gemm_ar example, their tables and sweep
analysis on synthetic data, and every script end to end on tiny odd shapes with real ranks (JSON structure and the error
column checked; no timing assertions: this machine is shared)."""
import collections
import json
import os
import random
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks")
sys.path.insert(0, BENCH)

from benchkit import crossover, metrics, models, plot, report, timing  # noqa: E402
from rank_pool import free_port  # noqa: E402

RUN_TIMEOUT_S = 400
# Worst relative error (max|out - ref| / max|ref|) a correct result can have, per dtype.
REL_TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 3e-3}


# --- formulas (docs/decisions/0012-benchmark-measures.md) against pto-isa's gemm_ar example's 8 x 910B table ---

def test_gemm_ar_example_figures_follow_from_the_formulas():
    compute, comm, pipelined = 371.6e-6, 437.3e-6, 560.6e-6
    sequential = compute + comm  # 808.9 us
    assert metrics.speedup(sequential, pipelined) == pytest.approx(1.443, abs=5e-4)
    assert metrics.time_saved(sequential, pipelined) == pytest.approx(248.3e-6, abs=1e-9)
    assert metrics.comm_time(sequential, compute) == pytest.approx(comm)
    assert metrics.overlap_efficiency(compute, comm, pipelined) == pytest.approx(0.668, abs=5e-4)


def test_overlap_efficiency_edge_cases():
    assert metrics.overlap_efficiency(1.0, 1.0, 1.0) == pytest.approx(1.0)  # the shorter phase fully hidden
    assert metrics.overlap_efficiency(1.0, 0.5, 1.5) == pytest.approx(0.0)  # no overlap at all
    assert metrics.overlap_efficiency(1.0, None, 1.0) is None  # no measurable communication
    assert metrics.comm_time(1.0, 1.2) is None


def test_gflops_and_bus_bandwidth():
    assert metrics.gflops(5416, 6144, 1408, 368.1e-6) == pytest.approx(254546, rel=1e-4)  # the example's compute-only
    # 2 ranks: each moves half the buffer in reduce-scatter and half in all-gather, i.e. the buffer once.
    assert metrics.allreduce_bus_bytes(1000, 1000, 4, 2) == pytest.approx(4e6)
    assert metrics.bus_bandwidth_gbs(1000, 1000, 4, 8, 1e-3) == pytest.approx(2 * 7 / 8 * 4e6 / 1e-3 / 1e9)
    assert metrics.bus_bandwidth_gbs(1000, 1000, 4, 1, 1e-3) is None


# Three iterations of two ranks, each (start, end): rank 1 is released from the barrier later in iterations 0 and 2.
STAMPS = [[(0.0, 1.0), (10.0, 15.0), (20.0, 22.0)],
          [(0.5, 1.25), (10.0, 13.0), (21.0, 22.5)]]


def test_row_stats_count_an_iteration_from_its_last_start_on_one_clock():
    stats = metrics.row_stats(STAMPS, one_clock=True)
    assert stats["iteration_s"] == [0.75, 5.0, 1.5]  # last end - last start: rank 0's wait for rank 1 is left out
    assert (stats["median_s"], stats["min_s"], stats["max_s"]) == (1.5, 0.75, 5.0)
    assert stats["timings_s"] == [[1.0, 5.0, 2.0], [0.75, 3.0, 1.5]]
    assert stats["rank_medians_s"] == [2.0, 1.5]


def test_row_stats_take_each_iterations_slowest_rank_across_clocks():
    # Negative control of the test above: without a shared clock the early rank's wait counts.
    stats = metrics.row_stats(STAMPS, one_clock=False)
    assert stats["iteration_s"] == [1.0, 5.0, 2.0]
    assert (stats["median_s"], stats["min_s"], stats["max_s"]) == (2.0, 1.0, 5.0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_williams_orders_put_every_row_after_every_other_equally_often(n):
    orders = timing.williams_orders(n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    follows = collections.Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    if n > 1:
        assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
        assert len(set(follows.values())) == 1, follows
    # Negative control: rotating one order (the earlier scheme) keeps every row's predecessor.
    rotations = [list(range(s, n)) + list(range(s)) for s in range(n)]
    rotated = collections.Counter((a, b) for order in rotations for a, b in zip(order, order[1:]))
    assert n <= 2 or len(rotated) < n * (n - 1)


def test_first_index_from_which():
    assert metrics.first_index_from_which([False, True, False, True, True]) == 3
    assert metrics.first_index_from_which([True, True]) == 0
    assert metrics.first_index_from_which([True, False]) is None
    assert metrics.first_index_from_which([]) is None


# --- tables and sweep analysis -------------------------------------------------------------------------------------

def test_table_columns_are_aligned():
    text = report.format_table(["name", "time us", "x"], [["a", "1.0", "2"], ["longer name", "12,345.6", "0.5"],
                                                          ["gone", "absent: why"]])
    lines = text.splitlines()
    assert lines[2].index("1.0") + 3 == lines[3].index("12,345.6") + 8  # numbers right-aligned
    assert lines[2].startswith("a ") and lines[3].startswith("longer name")
    assert lines[4] == "gone         absent: why"
    assert set(lines[1].replace(" ", "")) == {"-"}


def _point(times, auto_iterations=None):
    rows = {k: {"available": t is not None, "median_s": t, "iteration_s": [t] * 7} for k, t in times.items()}
    if auto_iterations is not None:
        rows["auto"]["iteration_s"] = auto_iterations
    return {"rows": rows}


def test_crossovers_thresholds_and_auto_floor():
    ms = [1, 16, 256, 4096]
    layer_a = [_point({"sequential": 1.0, "chunked": 2.0, "auto": 1.0, "baseline": 1.0}),
               _point({"sequential": 1.0, "chunked": 0.9, "auto": 1.0, "baseline": 1.0}),
               _point({"sequential": 1.0, "chunked": 1.1, "auto": 1.0, "baseline": 0.9}),  # auto at 0.9x
               _point({"sequential": 2.0, "chunked": 1.0, "auto": 1.0, "baseline": 1.0})]
    layer_b = [_point({"sequential": 1.0, "chunked": 0.5, "auto": 0.5, "baseline": 1.0}) for _ in ms]
    result = crossover.analyse(["a", "b"], ms, [layer_a, layer_b])
    assert result["crossovers"]["a"] == {"chunked": 4096, "fused": None}
    assert result["crossovers"]["b"] == {"chunked": 1, "fused": None}
    assert result["recommended_thresholds"] == {"min_m_for_chunked": 4096, "min_m_for_fused": None}
    assert result["best_by_layer"]["a"] == ["sequential", "chunked", "sequential", "chunked"]
    assert [(r["layer"], r["m"]) for r in result["auto_below_floor"]] == [("a", 256)]
    assert result["auto_worst"]["speed_vs_baseline"] == pytest.approx(0.9)
    # auto against the best single algorithm per point: 1/1, 0.9/1, 1/1, 1/1 on a; 0.5/0.5 on b.
    assert [(r["layer"], r["m"], r["best"]) for r in result["auto_below_best_floor"]] == [("a", 16, "chunked")]
    assert result["auto_worst_vs_best"]["speed_vs_best"] == pytest.approx(0.9)
    assert len(result["auto_vs_best"]) == 8


def test_auto_with_another_tile_family_of_the_best_algorithm_is_counted_apart():
    points = []
    for choice in ("fused", "fused/tiles", "fused/few-products", "sequential/x", "chunked"):
        point = _point({"sequential": 2.0, "fused": 1.0, "auto": 1.0, "baseline": 2.0})
        point["auto_choice"] = choice
        points.append(point)
    result = crossover.analyse(["a"], [1, 16, 256, 1024, 4096], [points])
    assert result["auto_chose_best"] == 1  # fused itself
    assert result["auto_chose_best_family"] == 2  # fused with a tile family; not another algorithm's name


def test_auto_under_a_floor_only_by_noise_is_told_apart_from_auto_below_it():
    # Against a best row of 1.0 s in every iteration: auto's iterations scatter around 1.0 (median ratio 0.952, its
    # interval reaching past 1), or sit 10% slower in every iteration (0.909, the interval with it).
    noisy = [1.2, 0.85, 1.15, 0.9, 1.05, 1.1, 0.95]
    slower = [1.1, 1.1, 1.1, 1.1, 1.1, 1.1, 1.1]
    points = [_point({"sequential": 1.0, "auto": 1.0, "baseline": 1.0}, noisy),
              _point({"sequential": 1.0, "auto": 1.0, "baseline": 1.0}, slower)]
    result = crossover.analyse(["a"], [1, 16], [points])
    noise = result["auto_under_best_floor_within_noise"]
    assert [r["m"] for r in noise] == [1] and noise[0]["speed_vs_best"] == pytest.approx(1 / 1.05)
    assert noise[0]["interval"][0] < 0.97 <= noise[0]["interval"][1]
    assert [r["m"] for r in result["auto_below_best_floor"]] == [16]
    assert [r["m"] for r in result["auto_below_floor"]] == [16]
    assert result["auto_below_best_floor"][0]["interval"] == [pytest.approx(1 / 1.1)] * 2


def test_target_cells_say_ok_over_or_miss_by_the_interval():
    def cell(estimate, low, high):
        return report.target_cell({"estimate": estimate, "low": low, "high": high}, 1.08)

    assert cell(1.05, 1.01, 1.09) == "1.050 (1.010-1.090) ok"
    assert cell(1.10, 1.07, 1.13) == "1.100 (1.070-1.130) over"  # the interval reaches 1.08
    assert cell(1.10, 1.09, 1.12) == "1.100 (1.090-1.120) MISS"
    assert report.target_cell(None, 1.08) == "-"


def test_paired_speedup_is_the_median_ratio_with_a_reproducible_interval():
    speed = metrics.paired_speedup([2.0, 2.0, 2.0, 4.0], [1.0, 1.0, 2.0, 1.0])
    assert speed["estimate"] == pytest.approx(2.0) and speed["iterations"] == 4
    assert speed["low"] <= speed["estimate"] <= speed["high"]
    assert speed == metrics.paired_speedup([2.0, 2.0, 2.0, 4.0], [1.0, 1.0, 2.0, 1.0])


def test_model_layers():
    layers = {(layer.model, layer.projection, layer.tp): layer
              for layer in models.layers(["Llama-3.1-8B"], [2, 8], scale=1)}
    assert (layers["Llama-3.1-8B", "o_proj", 2].k, layers["Llama-3.1-8B", "o_proj", 2].n) == (2048, 4096)
    assert (layers["Llama-3.1-8B", "down_proj", 8].k, layers["Llama-3.1-8B", "down_proj", 8].n) == (1792, 4096)
    # scale divides N only: each layer keeps its real K (its flops per output element) unless k_scale says otherwise.
    scaled = models.layers(["Llama-3.1-70B"], [4], scale=8)
    assert [(layer.k, layer.n) for layer in scaled] == [(2048, 1024), (7168, 1024)]
    both = models.layers(["Llama-3.1-70B"], [4], scale=8, k_scale=8)
    assert [(layer.k, layer.n) for layer in both] == [(256, 1024), (896, 1024)]
    with pytest.raises(ValueError, match="unknown model"):
        models.layers(["GPT-5"], [2], 1)


@pytest.mark.skipif(plot.matplotlib_missing() is not None, reason="matplotlib is not installed: no plot to check")
def test_speedup_plot_writes_a_png(tmp_path):
    ms = [1, 16]
    points = [{"rows": {"chunked": {"available": True, "speedup_vs_baseline": s}}} for s in (0.8, 1.2)]
    path = str(tmp_path / "p.png")
    plot.speedup_plot(path, "t", ["layer"], ms, [points], 0.97)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# --- rows: the fused engine is picked up once it exists -------------------------------------------------------

class StubLibrary:
    """Records how the rows call the library, with or without the fused engine's sequential mode."""

    def __init__(self, with_mode):
        self.calls, self.overlap = [], None
        if with_mode:
            import contextlib
            import types

            @contextlib.contextmanager
            def override(overlap=True):
                self.overlap = overlap
                try:
                    yield
                finally:
                    self.overlap = None

            self.engine_options = types.SimpleNamespace(override=override)

    def gemm_allreduce(self, a, b, group=None, *, bias=None, algorithm="auto"):
        self.calls.append((algorithm, self.overlap))
        return a @ b


@pytest.mark.parametrize("with_mode", [True, False])
def test_same_engine_sequential_row(with_mode):
    import types

    import torch

    from benchkit.inputs import InputSet
    from benchkit.rows import build_rows

    lib = StubLibrary(with_mode)
    env = types.SimpleNamespace(library=lib, group="world", self_group="self", device=torch.device("cpu"), rank=0)
    sets = [InputSet(torch.randn(3, 2), torch.randn(2, 5), None)]
    rows = build_rows(env, sets, torch.float32, ["fused_sequential", "fused"])
    rows["fused_sequential"].run(0)
    rows["fused"].run(0)
    if with_mode:
        assert lib.calls == [("fused", False), ("fused", None)]
        assert rows["fused_sequential"].note == ""
    else:
        assert lib.calls == [("sequential", None), ("fused", None)]
        assert "engine_options" in rows["fused_sequential"].note
    assert rows["fused"].sequential_ref == "fused_sequential"


def _time_a_short_and_a_long_call(rank, world):
    import time

    calls = []

    def short():
        calls.append("short")
        time.sleep(0.002)

    def long():  # long on rank 1 only: the iteration waits for its slowest rank
        calls.append("long")
        time.sleep(0.002 if rank == 0 else 0.015)

    return calls, timing.time_callables([short, long], warmup=1, iters=6)


def test_time_callables_interleave_and_count_every_rank(ranks):
    results = ranks(2).run(_time_a_short_and_a_long_call)
    for calls, (short_s, long_s) in results:
        assert calls[:2] == ["short", "long"] and len(calls) == 2 + 2 * 6, calls  # a warm-up round, then 6 each
        assert calls[2:6] == ["short", "long", "long", "short"], calls  # each follows the other equally often
        assert len(short_s) == len(long_s) == 6
        # Rank 1's 15 ms sleep, on rank 0 too. An iteration runs from the last rank's start to the last rank's end,
        # so it may come out shorter than the sleep by the ranks' start skew after the barrier: 1 ms of slack.
        assert min(long_s) >= 0.014, long_s
        assert sorted(short_s)[3] < sorted(long_s)[3], (short_s, long_s)
    assert results[0][1] == results[1][1]  # every rank gets the same iteration times


# --- the scripts end to end ------------------------------------------------------------------------------------------

def run_script(script, *args, torchrun=True):
    args = [*args, "--seed", str(random.randrange(1 << 30))]  # fresh inputs on every test run
    if torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1",
                   "--master-addr=127.0.0.1", f"--master-port={free_port()}", os.path.join(BENCH, script), "--",
                   *args]
    else:
        command = [sys.executable, os.path.join(BENCH, script), *args]
    # The installed torch_gemm_ar (or PYTHONPATH's), never the bare source tree, which has no compiled _C.
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=REPO)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    return done.stdout


def check_shape_summary(summary, dtype, world=2, iters=None):
    rows = summary["rows"]
    for key, entry in rows.items():
        if not entry["available"]:
            # Only an algorithm this build cannot run may be absent, and it says why.
            assert key in ("fused", "fused_sequential"), f"{key} absent: {entry.get('reason')}"
            assert "not available" in entry["reason"]
            continue
        assert len(entry["timings_s"]) == world
        if iters is not None:
            assert all(len(times) == iters for times in entry["timings_s"]), key
        assert all(t > 0 for times in entry["timings_s"] for t in times)
        assert entry["min_s"] <= entry["median_s"] <= entry["max_s"]
        if key == "traffic_floor":
            # A lower bound that does not compute the op: no error against float64 claimed, nothing compared.
            assert "max_rel_error" not in entry and entry["identical_on_all_ranks"] is None
            assert entry["speedup_vs_baseline"] is None
            continue
        assert entry["max_rel_error"] < REL_TOL[dtype], f"{key}: relative error {entry['max_rel_error']}"
        local = key in ("compute_only", "compute_reused", "engine_gemm")  # each rank's own product, not the reduced one
        if not local:
            assert entry["identical_on_all_ranks"], f"{key}: ranks returned different tensors"
        if not local and key != "allreduce_only":
            assert entry["speedup_vs_baseline"] > 0
    return rows


def test_bench_gemm_allreduce_end_to_end(tmp_path):
    out = str(tmp_path / "bench.json")
    stdout = run_script("bench_gemm_allreduce.py", "--m", "37", "--k", "19", "--n", "23", "--bias", "--iters", "2",
                        "--warmup", "1", "--json", out)
    with open(out) as f:
        result = json.load(f)
    assert result["shape"] == {"m": 37, "k": 19, "n": 23, "dtype": "float32", "bias": True, "world": 2,
                               "flops_per_rank": 2 * 37 * 19 * 23}
    assert result["run"]["command"].startswith("torchrun --nproc-per-node 2 benchmarks/bench_gemm_allreduce.py --")
    rows = check_shape_summary(result, "float32", iters=2)
    assert list(rows) == ["compute_only", "compute_reused", "engine_gemm", "traffic_floor", "allreduce_only",
                          "sequential", "sequential_portable", "chunked", "fused_sequential", "fused", "auto",
                          "baseline"]
    assert rows["chunked"]["sequential_reference"] == "sequential"
    assert rows["chunked"]["speedup_vs_sequential"] > 0
    # Defined only when sequential took longer than compute alone, which 2 timed calls of a tiny shape on a loaded
    # machine do not promise: checked against the formula on the report's own medians.
    t_comp, t_seq = rows["compute_only"]["median_s"], rows["sequential"]["median_s"]
    expected = metrics.overlap_efficiency(t_comp, metrics.comm_time(t_seq, t_comp), rows["chunked"]["median_s"])
    assert rows["chunked"]["overlap_efficiency"] == (pytest.approx(expected) if expected is not None else None)
    assert rows["baseline"]["speedup_vs_baseline"] == pytest.approx(1.0)
    # The table names every row and shows the error column.
    for label in ("compute only", "engine GEMM only", "sequential", "chunked", "fused", "auto", "baseline (float32)",
                  "rel err"):
        assert label in stdout
    assert result["ratios"]["engine_gemm_over_compute_only"] > 0 and "engine GEMM only / compute-only" in stdout
    # fused is also set against the GEMM into a reused output (no page faults of a fresh one, as fused's pool).
    assert result["ratios"]["fused_over_compute_reused"] > 0 and "compute only (reused out)" in stdout
    assert "fused / compute-only into a reused output" in stdout
    # The floor of any fused flow on this CPU, with the GEMM form it timed faster.
    assert result["ratios"]["traffic_floor_over_compute_only"] > 0 and result["ratios"]["fused_over_traffic_floor"] > 0
    assert "floor / compute-only = " in stdout and "fused / floor = " in stdout
    assert "its GEMM here: every rank's" in stdout
    # What auto decided before the timed calls (37 x 23 is a bucket auto tunes: a candidate's name, not a guess).
    assert result["auto_choice"] in ("sequential", "chunked", "fused", "fused/tiles", "fused/few-products",
                                     "fused/gathered-inputs"), result["auto_choice"]
    assert f"auto ran: {result['auto_choice']} (decided by measurement" in stdout


def test_bench_bfloat16_reports_the_fair_baselines(tmp_path):
    """The fp32-compute baseline is measured where the library computes bf16 in fp32 (CPUs without bf16 matrix
    instructions), and left out where it computes bf16 natively."""
    from torch_gemm_ar import _C
    out = str(tmp_path / "bench.json")
    run_script("bench_gemm_allreduce.py", "--m", "33", "--k", "65", "--n", "7", "--dtype", "bfloat16",
               "--algorithms", "chunked", "--iters", "1", "--warmup", "0", "--json", out)
    with open(out) as f:
        result = json.load(f)
    rows = check_shape_summary(result, "bfloat16", iters=1)
    # chunked pulls in sequential; compute only and the baselines that apply are always measured.
    if _C._computes_in_fp32(torch.empty(0, dtype=torch.bfloat16)):
        assert list(rows) == ["compute_only", "sequential", "chunked", "baseline", "baseline_fp32"]
        assert "fp32" in rows["baseline"]["note"]
    else:
        assert list(rows) == ["compute_only", "sequential", "chunked", "baseline"]
        assert "note" not in rows["baseline"] or "fp32" not in (rows["baseline"]["note"] or "")


def test_bench_cpu_fused_end_to_end(tmp_path):
    out = str(tmp_path / "fused.json")
    stdout = run_script("bench_cpu_fused.py", "--shapes", "37x19x23,5x130x9", "--iters", "2", "--warmup", "1",
                        "--json", out)
    with open(out) as f:
        result = json.load(f)
    assert result["target_fused_over_compute_only"] == pytest.approx(1.08)
    assert result["target_engine_gemm_over_compute_only"] == pytest.approx(1.02)
    assert [(s["shape"]["m"], s["shape"]["k"], s["shape"]["n"]) for s in result["shapes"]] == [(37, 19, 23), (5, 130, 9)]
    for summary in result["shapes"]:
        rows = check_shape_summary(summary, "float32", iters=2)
        assert list(rows) == ["compute_only", "compute_reused", "engine_gemm", "traffic_floor", "fused_sequential",
                              "fused", "baseline"]
        assert summary["ratios"]["engine_gemm_over_compute_only"] > 0
        assert summary["ratios"]["fused_over_compute_reused"] > 0
        paired = summary["ratios"]["engine_gemm_over_compute_only_paired"]
        assert 0 < paired["low"] <= paired["estimate"] <= paired["high"]
        if rows["fused"]["available"]:
            assert summary["ratios"]["fused_over_compute_only"] > 0
            paired = summary["ratios"]["fused_over_compute_only_paired"]
            assert 0 < paired["low"] <= paired["estimate"] <= paired["high"]
    assert "fused/compute" in stdout and "engine GEMM/compute" in stdout


def test_bench_cpu_fused_compares_outputs_in_window_slots(tmp_path, monkeypatch):
    """With TORCH_GEMM_AR_SHARED_OUTPUTS the benchmark adds fused with private outputs, and the paired ratio of the
    two, at a shape whose output takes a slot on one-core ranks (1 MiB or more, not one-shot)."""
    monkeypatch.setenv("TORCH_GEMM_AR_SHARED_OUTPUTS", "2")
    monkeypatch.setenv("TORCH_GEMM_AR_COMM_THREADS", "0")
    monkeypatch.setenv("TORCH_GEMM_AR_COMPUTE_THREADS", "1")
    out = str(tmp_path / "fused.json")
    stdout = run_script("bench_cpu_fused.py", "--shapes", "1100x19x1030", "--iters", "3", "--warmup", "1",
                        "--json", out)
    with open(out) as f:
        (summary,) = json.load(f)["shapes"]
    rows = check_shape_summary(summary, "float32", iters=3)
    assert list(rows) == ["compute_only", "compute_reused", "engine_gemm", "traffic_floor", "fused_sequential",
                          "fused", "fused_private", "baseline"]
    paired = summary["ratios"]["fused_over_fused_private_paired"]
    assert 0 < paired["low"] <= paired["estimate"] <= paired["high"]
    assert "fused / fused with private outputs = " in stdout


def test_bench_sequence_parallel_end_to_end(tmp_path):
    out = str(tmp_path / "sp.json")
    stdout = run_script("bench_sequence_parallel.py", "--shapes", "38x19x23,6x130x9", "--iters", "2", "--warmup", "1",
                        "--json", out)
    with open(out) as f:
        result = json.load(f)
    assert result["targets"] == {"gemm_reduce_scatter": 1.08, "allgather_gemm": 1.10}
    assert [(s["shape"]["m"], s["shape"]["k"], s["shape"]["n"]) for s in result["shapes"]] == [(38, 19, 23), (6, 130, 9)]
    for summary in result["shapes"]:
        assert list(summary["ops"]) == ["gemm_reduce_scatter", "allgather_gemm"]
        for op in summary["ops"].values():
            rows = op["rows"]
            assert list(rows) == ["compute_only", "user", "sequential", "fused"]
            for key, entry in rows.items():
                assert len(entry["timings_s"]) == 2 and all(len(t) == 2 for t in entry["timings_s"]), key
                assert entry["min_s"] <= entry["median_s"] <= entry["max_s"]
                if key != "compute_only":
                    assert entry["max_rel_error"] < REL_TOL["float32"], f"{key}: {entry['max_rel_error']}"
            assert op["ratios"]["fused_over_compute_only"] > 0 and op["ratios"]["fused_over_user"] > 0
    for label in ("gemm_reduce_scatter", "allgather_gemm", "fused/compute", "fused/user"):
        assert label in stdout


def test_quick_sweep_end_to_end(tmp_path):
    out_dir = str(tmp_path / "sweep")
    # Launched without torchrun, as the README shows: the script starts its own 2 ranks.
    stdout = run_script("sweep.py", "--out", out_dir, "--quick", "--scale", "256", "--k-scale", "256",
                        "--m-list", "1,5,33",
                        "--models", "Llama-3.2-1B", "--tp", "2", "--max-iters", "2", "--budget-s", "0.01",
                        torchrun=False)
    with open(os.path.join(out_dir, "sweep.json")) as f:
        result = json.load(f)
    assert result["m_list"] == [1, 5, 33]
    assert [(e["projection"], e["k"], e["n"]) for e in result["layers"]] == [("o_proj", 4, 8), ("down_proj", 16, 8)]
    for layer in result["layers"]:
        assert [p["shape"]["m"] for p in layer["points"]] == [1, 5, 33]
        for point in layer["points"]:
            rows = check_shape_summary(point, "float32")
            assert list(rows) == ["sequential", "chunked", "fused", "auto", "baseline"]
    analysis = result["analysis"]
    assert set(analysis["crossovers"]) == {e["name"] for e in result["layers"]}
    assert set(analysis["recommended_thresholds"]) == {"min_m_for_chunked", "min_m_for_fused"}
    assert analysis["auto_worst"] is not None
    assert analysis["auto_worst_vs_best"] is not None
    assert "Where auto should switch" in stdout and "auto vs baseline" in stdout
    assert "auto vs best single algorithm: worst" in stdout and "auto/best x" in stdout
    if plot.matplotlib_missing() is None:
        with open(os.path.join(out_dir, "sweep.png"), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    else:
        assert result["plot"] is None and "matplotlib" in result["plot_missing_reason"]


# --- the command lines of README.md and docs/*.md, as typed ---------------------------------------------------------

DOC_FILES = [os.path.join(REPO, "README.md")] + sorted(
    os.path.join(REPO, "docs", f) for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md"))
# Appended to a documented command to make it tiny (argparse: the last occurrence of an option wins).
TINY_ARGS = {
    "bench_gemm_allreduce.py": ["--M", "37", "--K", "19", "--N", "23", "--iters", "1", "--warmup", "0",
                                "--input-sets", "1"],
    "bench_cpu_fused.py": ["--shapes", "37x19x23", "--iters", "1", "--warmup", "0", "--input-sets", "1"],
    "bench_add_rmsnorm.py": ["--shapes", "37x19x23", "--iters", "1", "--warmup", "0", "--input-sets", "1"],
    "bench_decode.py": ["--m-list", "37", "--layers", "19x23", "--dtypes", "float32", "--iters", "1", "--warmup", "1",
                        "--input-sets", "1"],
    # M is the whole sequence there: divisible by the 2 ranks.
    "bench_sequence_parallel.py": ["--shapes", "38x19x23", "--iters", "1", "--warmup", "0", "--input-sets", "1"],
    "sweep.py": ["--models", "Llama-3.2-1B", "--tp", "2", "--m-list", "1,5", "--scale", "256", "--k-scale", "256",
                 "--max-iters", "1", "--min-iters", "1", "--warmup", "0", "--budget-s", "0.01"],
}


def documented_commands():
    """(file, command words) of every benchmark command line in the docs: `torchrun ... benchmarks/x.py ...` and
    `python benchmarks/x.py ...`, continuation lines joined; in a synopsis, [optional] parts are kept and the first
    of a|b|c alternatives is taken, so the synopsis is checked as a command too."""
    import re
    import shlex

    found = []
    for path in DOC_FILES:
        with open(path) as f:
            text = f.read().replace("\\\n", " ")
        for line in text.splitlines():
            for match in re.finditer(r"((?:torchrun(?: [^\s`#&;]+)*?|python3?) benchmarks/\w+\.py[^`#\n&;]*)", line):
                command = match.group(1).replace("[", " ").replace("]", " ")
                words = [w.split("|")[0] for w in shlex.split(command)]
                if line.lstrip().startswith("command:"):
                    continue  # a report's record of a past run, not an instruction
                found.append((os.path.relpath(path, REPO), words))
    return found


def test_the_docs_show_torchrun_command_lines():
    commands = documented_commands()
    scripts = {os.path.basename(next(w for w in words if w.endswith(".py"))) for _, words in commands}
    assert scripts == set(TINY_ARGS), scripts
    torchrun_scripts = {os.path.basename(script_and_args(words)[1]) for _, words in commands if words[0] == "torchrun"}
    assert {"bench_gemm_allreduce.py", "sweep.py"} <= torchrun_scripts
    assert any(words[0] == "torchrun" and "--M" in words for _, words in commands)


def script_and_args(words):
    index = next(i for i, w in enumerate(words) if w.endswith(".py"))
    return words[:index], words[index], words[index + 1:]


@pytest.mark.parametrize("doc,words", documented_commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_documented_command_parses(doc, words):
    """torchrun's own parser hands every script option through unchanged (it stops at an ambiguous abbreviation
    such as --m), and the script's parser accepts them."""
    import importlib

    from torch.distributed.run import get_args_parser

    launcher, script, args = script_and_args(words)
    if launcher[0] == "torchrun":
        parsed = get_args_parser().parse_args([*launcher[1:], script, *args])
        assert parsed.training_script == script
        assert parsed.training_script_args == args, f"{doc}: torchrun took script options for its own"
    module = importlib.import_module(os.path.splitext(os.path.basename(script))[0])
    module.parse_args(args)


def test_lowercase_shape_options_stay_aliases():
    import bench_gemm_allreduce

    lower = bench_gemm_allreduce.parse_args(["--m", "5", "--k", "6", "--n", "7"])
    upper = bench_gemm_allreduce.parse_args(["--M", "5", "--K", "6", "--N", "7"])
    assert (lower.m, lower.k, lower.n) == (upper.m, upper.k, upper.n) == (5, 6, 7)


def test_torchrun_parser_negative_control():
    """The check above can fail: torchrun stops at an ambiguous abbreviation such as --m after the script."""
    from torch.distributed.run import get_args_parser

    with pytest.raises(SystemExit):
        get_args_parser().parse_args(["--nproc-per-node", "2", "benchmarks/bench_gemm_allreduce.py", "--m", "4096"])


def distinct_torchrun_commands():
    """Each documented torchrun line once (several docs show the same one), with the first doc that shows it."""
    first = {}
    for doc, words in documented_commands():
        if words[0] == "torchrun":
            first.setdefault(tuple(words), (doc, words))
    return list(first.values())


@pytest.mark.parametrize("doc,words", distinct_torchrun_commands(),
                         ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_documented_torchrun_command_runs(doc, words, tmp_path):
    """The documented torchrun line itself (torchrun from this environment, on a free port via its PET_MASTER_PORT
    variable), made tiny by options appended after the documented ones."""
    launcher, script, args = script_and_args(words)
    name = os.path.basename(script)
    args = [str(tmp_path / "out") if a in ("DIR", "out.json") else a for a in args]
    extra = list(TINY_ARGS[name]) + ["--seed", str(random.randrange(1 << 30))]
    if name != "sweep.py":
        extra += ["--json", str(tmp_path / "out.json")]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PET_MASTER_PORT=str(free_port()), PET_MASTER_ADDR="127.0.0.1")
    done = subprocess.run([torchrun, *launcher[1:], script, *args, *extra], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, cwd=REPO, env=env)
    assert done.returncode == 0, f"{' '.join(words)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    if name == "sweep.py":
        assert os.path.exists(tmp_path / "out" / "sweep.json")
    else:
        with open(tmp_path / "out.json") as f:
            result = json.load(f)
        first_shape = result["shapes"][0] if "shapes" in result else result  # multi-shape scripts keep a list
        assert first_shape["shape"]["m"] == (38 if name == "bench_sequence_parallel.py" else 37)
