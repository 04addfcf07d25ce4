"""The strict kernel simulator with what a busy device adds to it (csrc/kernels/sim_data_cache.hpp, the harness
tests/kernels_sim/sim_main.cpp; both switched on per run by environment variables):

- eviction: a dirty cache line may be written back and dropped at any scalar access, not only at the kernel's dcci;
- posted write-backs: a write-back lands in memory after a random delay, in any order, until the core's next dsb;
- a cap on the comm blocks a rank can run at once (fewer free vector cores than blocks);
- two calls of one group with the same epoch running at once (a host that did not order them across streams);
- asynchronous DMA: a tile store to GM completes (and reads its local tile) only at the core's next
  synchronisation point on its pipe (a wait_flag for a later set_flag of that pipe, a pipe barrier, a fence).

Always on, whatever the models: the set_flag/wait_flag balance of every core (no wait without a pending set, no set
left at a kernel's end), counted in model_counters.txt like the models' counters.

The protocol's job mixes must still pass with eviction, posted write-backs and asynchronous DMA on, and each part has a negative control it alone can
see: the same run without it passes (the model before it was blind to that bug), with it the test names the
failure (a counter, an error code, or wrong values).

bf16: as in test_kernels_sim.py, with g++ < 13 pto-isa's simulator stores bfloat16_t as an IEEE half."""
import os
import time

import numpy as np
import pytest

from test_kernels_sim import (_CONTROL_CALLS, B_ROW_MAJOR, B_TRANSPOSED, BF16, CLOBBER_RANDOM,
                              ERR_SIGNATURE_MISMATCH, ERR_TIMEOUT_PREPARE, FP16, SP_ALLGATHER, SP_REDUCE_SCATTER,
                              _check_call, _check_clean_run, _check_values, _decode, _run_job, _unit_roundoff, pytestmark)
from test_kernels_sim_add_rmsnorm import _check_epilogue_call
from test_kernels_sim_sequence_parallel import _check_sp_call

__all__ = ["pytestmark"]  # the skip reason

# NegativeControl values of csrc/kernels/device_support.hpp that only these models can see.
CONTROL_FLAG_STORED_EARLY = 60  # a contribution flag's words stored before the fence after the atomic add
CONTROL_SIGNATURE_UNFENCED = 61  # the signature's flag raised without the fence after the words' write-back
CONTROL_DROP_WAIT_FLAG = 62  # a compute tile's last wait_flag(PIPE_M, PIPE_MTE1, EVENT_ID1) left out
CONTROL_MOVE_TILE_REUSED = 63  # sequence-parallel move(): no MTE3 -> MTE2 hand-over before the UB tile is refilled

# The environment variables of the models (sim_data_cache.hpp, sim_main.cpp); every run sets all of them.
_MODEL_VARS = ("GEMM_AR_SIM_EVICT_PERMILLE", "GEMM_AR_SIM_POSTED_US", "GEMM_AR_SIM_MODEL_SEED",
               "GEMM_AR_SIM_RESIDENT_COMM_BLOCKS", "GEMM_AR_SIM_CONCURRENT_CALLS", "GEMM_AR_SIM_ASYNC_DMA")
EVICT = {"GEMM_AR_SIM_EVICT_PERMILLE": "250"}  # a quarter of the scalar accesses that find a dirty line evict one
POSTED = {"GEMM_AR_SIM_POSTED_US": "300"}  # write-backs land 0-300 us late unless a dsb waits for them
ASYNC = {"GEMM_AR_SIM_ASYNC_DMA": "1"}  # tile stores land at the next synchronisation point of their pipe


def _run(monkeypatch, sim, path, model, **kw):
    """_run_job in its own directory with exactly `model`'s variables set; also returns the model's counters."""
    os.makedirs(path, exist_ok=True)
    with monkeypatch.context() as env:
        for name in _MODEL_VARS:
            env.delenv(name, raising=False)
        env.setenv("GEMM_AR_SIM_MODEL_SEED", "7")
        for name, value in model.items():
            env.setenv(name, value)
        cases, results = _run_job(sim, path, **kw)
    with open(os.path.join(path, "model_counters.txt")) as f:
        counters = {name: int(value) for name, value in (line.split() for line in f)}
    return cases, results, counters


def _check_model_counters(model, counters):
    # A run that turned a model on but never exercised it would prove nothing.
    if "GEMM_AR_SIM_EVICT_PERMILLE" in model:
        assert counters["evicted_lines"] > 0, counters
    if "GEMM_AR_SIM_POSTED_US" in model:
        assert counters["posted_writebacks"] > 0, counters
    if "GEMM_AR_SIM_ASYNC_DMA" in model:
        assert counters["deferred_tile_stores"] > 0, counters
    _check_flag_balance(counters)
    # No scalar store of the kernels reaches memory while a payload store of its core is unfenced.
    assert counters["unfenced_writebacks"] == 0, counters


def _check_flag_balance(counters):
    # A wait_flag with no pending set_flag would hang the core; a set_flag left at a kernel's end would release the
    # next kernel's wait early.
    assert counters["sync_waits_without_set"] == 0, counters
    assert counters["sync_sets_unwaited"] == 0, counters


# The job mixes of test_kernels_sim.py (and of the sequence-parallel and epilogue files): shapes off the tiles,
# both b layouts, bias, padded strides, epochs across the 2^32 wrap, windows clobbered between calls, a late peer.
_WORLD2_ODD_SHAPES = [
    dict(m=200, n=300, k=300, b_layout=B_TRANSPOSED, bias=True, lda_pad=5, epoch=0xFFFFFFFE),
    dict(m=130, n=260, k=70, b_layout=B_ROW_MAJOR, bias=False, ldb_pad=3, ldo_pad=7, epoch=0xFFFFFFFF,
         clobber_after=CLOBBER_RANDOM),
    dict(m=64, n=40, k=520, b_layout=B_TRANSPOSED, bias=True, ldo_pad=2, epoch=0),
    dict(m=257, n=513, k=33, b_layout=B_ROW_MAJOR, bias=True, epoch=1),
]
_WORLD3_LATE_PEER = [
    dict(m=150, n=270, k=100, b_layout=B_TRANSPOSED, bias=True, epoch=7, late_rank=1, late_us=50_000),
    dict(m=300, n=100, k=260, b_layout=B_ROW_MAJOR, bias=False, lda_pad=1, epoch=8),
    dict(m=70, n=520, k=90, b_layout=B_TRANSPOSED, bias=True, ldo_pad=1, epoch=9),
]
_MIXES = {
    # name: (run_job arguments, check(sim, case, results, call))
    "world2_fp16_odd_shapes": (
        dict(world=2, dtype=FP16, compute_blocks=3, comm_blocks=2, calls=_WORLD2_ODD_SHAPES, seed=11),
        lambda sim, case, results, c: _check_call(sim, FP16, 2, case, results, c)),
    "world3_bf16_late_peer": (
        dict(world=3, dtype=BF16, compute_blocks=2, comm_blocks=3, calls=_WORLD3_LATE_PEER, seed=23),
        lambda sim, case, results, c: _check_call(sim, BF16, 3, case, results, c)),
    # The negative controls' calls: forged tags in every word between calls, the epoch through the device counter.
    "world3_forged_tags_via_counter": (
        dict(world=3, dtype=FP16, compute_blocks=2, comm_blocks=2,
             calls=[dict(c, via_counter=True) for c in _CONTROL_CALLS], seed=91),
        lambda sim, case, results, c: _check_call(sim, FP16, 3, case, results, c)),
    "reduce_scatter_world3_late_peer": (
        dict(world=3, dtype=FP16, compute_blocks=2, comm_blocks=3, op=SP_REDUCE_SCATTER, seed=1223,
             calls=[dict(m=150, n=270, k=100, b_layout=B_TRANSPOSED, bias=True, epoch=7, late_rank=1,
                         late_us=50_000),
                    dict(m=303, n=100, k=260, b_layout=B_ROW_MAJOR, bias=False, lda_pad=1, epoch=8)]),
        lambda sim, case, results, c: _check_sp_call(sim, FP16, 3, case, results, c, SP_REDUCE_SCATTER)),
    "allgather_world3_late_peer": (
        dict(world=3, dtype=FP16, compute_blocks=2, comm_blocks=3, op=SP_ALLGATHER, seed=1259,
             calls=[dict(m=150, n=270, k=100, b_layout=B_TRANSPOSED, bias=True, epoch=7, late_rank=1,
                         late_us=50_000),
                    dict(m=101, n=100, k=260, b_layout=B_ROW_MAJOR, bias=False, lda_pad=1, epoch=8)]),
        lambda sim, case, results, c: _check_sp_call(sim, FP16, 3, case, results, c, SP_ALLGATHER)),
    "add_rmsnorm_world3_late_peer": (
        dict(world=3, dtype=FP16, compute_blocks=2, comm_blocks=3, op=3, seed=1303,
             calls=[dict(m=129, n=270, k=100, b_layout=B_TRANSPOSED, bias=True, epoch=7, late_rank=1,
                         late_us=50_000),
                    dict(m=77, n=513, k=60, b_layout=B_ROW_MAJOR, bias=True, lda_pad=1, epoch=8)]),
        lambda sim, case, results, c: _check_epilogue_call(sim, FP16, 3, case, results, c)),
}
_MIX_MODELS = [
    ("world2_fp16_odd_shapes", "evict"), ("world2_fp16_odd_shapes", "posted"),
    ("world3_bf16_late_peer", "evict"), ("world3_bf16_late_peer", "posted"),
    ("world3_forged_tags_via_counter", "evict+posted"), ("reduce_scatter_world3_late_peer", "evict+posted"),
    ("allgather_world3_late_peer", "evict+posted"), ("add_rmsnorm_world3_late_peer", "evict+posted"),
    ("world2_fp16_odd_shapes", "evict+posted+async"), ("world3_bf16_late_peer", "async"),
    ("world3_forged_tags_via_counter", "evict+posted+async"), ("reduce_scatter_world3_late_peer", "evict+posted+async"),
    ("allgather_world3_late_peer", "evict+posted+async"), ("add_rmsnorm_world3_late_peer", "evict+posted+async"),
]
_MODELS = {"evict": EVICT, "posted": POSTED, "async": ASYNC, "evict+posted": dict(EVICT, **POSTED),
           "evict+posted+async": dict(EVICT, **POSTED, **ASYNC)}


@pytest.mark.parametrize("mix,model", _MIX_MODELS, ids=[f"{m}-{x}" for m, x in _MIX_MODELS])
def test_job_mixes_pass_under_the_busy_device_models(simulator, tmp_path, monkeypatch, mix, model):
    kw, check = _MIXES[mix]
    cases, results, counters = _run(monkeypatch, simulator, tmp_path, _MODELS[model], **kw)
    _check_model_counters(_MODELS[model], counters)
    for c, case in enumerate(cases):
        check(simulator, case, results, c)


def test_flag_stored_before_its_fence_is_seen_only_with_eviction(simulator, tmp_path, monkeypatch):
    # Control 60 stores a contribution flag's words after the atomic add but before its release fence, and
    # raise_flag writes them back after the fence. Without eviction nothing leaves the cache before that dcci, so the
    # bug is invisible. With eviction the line may be written back before the fence: the flag is visible ahead of the
    # payload it announces, which the model counts (unfenced_writebacks).
    kw = dict(world=3, dtype=FP16, compute_blocks=2, comm_blocks=2,
              calls=[dict(c, via_counter=True) for c in _CONTROL_CALLS], seed=91,
              negative_control=CONTROL_FLAG_STORED_EARLY)
    cases, results, counters = _run(monkeypatch, simulator, tmp_path / "no_eviction", {}, **kw)
    for c, case in enumerate(cases):
        _check_call(simulator, FP16, 3, case, results, c)
    assert counters["unfenced_writebacks"] == 0, counters
    _, _, counters = _run(monkeypatch, simulator, tmp_path / "eviction", EVICT, **kw)
    assert counters["evicted_lines"] > 0, counters
    assert counters["unfenced_writebacks"] > 0, f"control 60 went unnoticed with eviction on: {counters}"


def test_dropped_wait_flag_is_counted_by_the_flag_balance(simulator, tmp_path, monkeypatch):
    # Control 62 leaves out a compute tile's last wait_flag(PIPE_M, PIPE_MTE1, EVENT_ID1). The simulator's pipes
    # ignore flags, so every value still comes out right; the balance check (always on) counts the set_flags left
    # pending at the kernels' ends. The same calls without the control show none (and neither does any mix above).
    kw = dict(world=2, dtype=FP16, compute_blocks=2, comm_blocks=2, seed=620,
              calls=[dict(m=140, n=300, k=70, b_layout=B_TRANSPOSED, bias=True, epoch=620)])
    cases, results, counters = _run(monkeypatch, simulator, tmp_path / "kept", {}, **kw)
    _check_call(simulator, FP16, 2, cases[0], results, 0)
    _check_flag_balance(counters)
    cases, results, counters = _run(monkeypatch, simulator, tmp_path / "dropped", {},
                                    negative_control=CONTROL_DROP_WAIT_FLAG, **kw)
    assert all(results[(0, r)]["code"] == 0 for r in range(2)), results
    _check_values(simulator, FP16, 2, cases[0], 0)
    assert counters["sync_waits_without_set"] == 0, counters
    # One pending set per computed tile: ceil(M / 128) x ceil(N / 256) tiles (kernel_args.hpp's kNpuBaseM and
    # kNpuBaseN) on each of the 2 ranks.
    call = kw["calls"][0]
    tiles = -(-call["m"] // 128) * -(-call["n"] // 256)
    assert counters["sync_sets_unwaited"] == 2 * tiles, f"control 62 went uncounted: {counters}"


def _gathered_mismatches(sim, case):
    """Elements of every rank's gathered a that differ from the shards (exact: a copy)."""
    want = np.vstack(case["a_vals"])
    return sum(int(np.count_nonzero(_decode(g, FP16, sim["bf16_native"]).reshape(want.shape) != want))
               for g in case["gathered"])


def test_ub_tile_refilled_before_its_store_is_seen_only_with_async_dma(simulator, tmp_path, monkeypatch):
    # Control 63 leaves out move()'s MTE3 -> MTE2 hand-over (set_flag and wait_flag both: the balance stays even),
    # so the next piece's TLOAD may refill the UB tile before the stores of the last piece have read it. With stores
    # that complete at once (the simulator before) nothing changes and the call passes. With asynchronous DMA the
    # stores read the tile at the next fence: pieces of the shard land in the window and the gathered buffer with
    # a later piece's rows. No rank can tell (no error code, no counter): the gathered a and the output are wrong.
    kw = dict(world=3, dtype=FP16, compute_blocks=2, comm_blocks=3, op=SP_ALLGATHER, seed=630,
              calls=[dict(m=150, n=270, k=100, b_layout=B_TRANSPOSED, bias=True, epoch=630)],
              negative_control=CONTROL_MOVE_TILE_REUSED)
    cases, results, counters = _run(monkeypatch, simulator, tmp_path / "at_once", {}, **kw)
    _check_sp_call(simulator, FP16, 3, cases[0], results, 0, SP_ALLGATHER)
    _check_flag_balance(counters)
    cases, results, counters = _run(monkeypatch, simulator, tmp_path / "async", ASYNC, **kw)
    assert counters["deferred_tile_stores"] > 0, counters
    _check_flag_balance(counters)
    _check_clean_run(results, 3, 0)
    assert _gathered_mismatches(simulator, cases[0]) > 0, "control 63 went unnoticed with asynchronous DMA"
    assert _wrong_elements(simulator, FP16, 3, cases[0]) > 0, "control 63 left the output right"


# Every call another shape, and no clobber in between: a signature slot read too early still holds the whole
# signature of two calls before (same slot parity), which differs from this call's in M.
_SIGNATURE_CALLS = [dict(m=140 + 10 * i, n=300 - 20 * i, k=70, b_layout=i % 2, bias=bool(i % 2), epoch=300 + i)
                    for i in range(5)]


def test_signature_flag_without_its_fence_is_seen_only_with_posted_write_backs(simulator, tmp_path, monkeypatch):
    # Control 61 raises the signature slot's flag right after writing the words back, without the release fence
    # (dsb) in between. When a write-back reaches memory at the dcci the words are there before the flag anyway and
    # every call passes. With posted write-backs the flag's line can land before the words' lines:
    # a peer then reads a torn slot or the previous signature of that slot and stops the call with
    # kErrSignatureMismatch.
    kw = dict(world=3, dtype=FP16, compute_blocks=2, comm_blocks=2, calls=_SIGNATURE_CALLS, seed=301,
              negative_control=CONTROL_SIGNATURE_UNFENCED)
    cases, results, _ = _run(monkeypatch, simulator, tmp_path / "at_once", {}, timeout_us=3_000_000, **kw)
    for c, case in enumerate(cases):
        _check_call(simulator, FP16, 3, case, results, c)
    # Landing up to 5 ms late: a peer polling the flag sees it well before the words' lines land. The same model and
    # timeout without the control pass: the model alone does not make the mismatch.
    late = {"GEMM_AR_SIM_POSTED_US": "5000"}
    fenced = {name: value for name, value in kw.items() if name != "negative_control"}
    cases, results, _ = _run(monkeypatch, simulator, tmp_path / "posted_fenced", late, timeout_us=1_500_000,
                             process_timeout_s=300, **fenced)
    for c, case in enumerate(cases):
        _check_call(simulator, FP16, 3, case, results, c)
    _, results, counters = _run(monkeypatch, simulator, tmp_path / "posted", late,
                                timeout_us=1_500_000, process_timeout_s=300, **kw)
    assert counters["posted_writebacks"] > 0, counters
    codes = {key: res["code"] for key, res in results.items() if isinstance(key, tuple)}
    assert ERR_SIGNATURE_MISMATCH in codes.values(), f"control 61 went unnoticed with posted write-backs: {codes}"


def test_comm_blocks_that_cannot_all_run_at_once_fail_in_bound_on_every_rank(simulator, tmp_path, monkeypatch):
    # The comm blocks of all ranks wait on each other (block c's subtiles are zeroed, announced and gathered by
    # block c of every rank), so every block of a call must be resident at once. With room for 2 of 3, every rank
    # must give up within its timeout, name the rank whose block never announced itself, and poison `out`; with
    # room for all 3 the same call passes.
    call = dict(m=260, n=520, k=70, b_layout=B_TRANSPOSED, bias=True, epoch=410)
    kw = dict(world=3, dtype=FP16, compute_blocks=2, comm_blocks=3, seed=410)
    cases, results, _ = _run(monkeypatch, simulator, tmp_path / "room_for_all",
                             {"GEMM_AR_SIM_RESIDENT_COMM_BLOCKS": "3"}, calls=[call], timeout_us=3_000_000, **kw)
    _check_call(simulator, FP16, 3, cases[0], results, 0)
    timeout_s = 1.5
    start = time.monotonic()
    cases, results, _ = _run(monkeypatch, simulator, tmp_path / "room_for_two",
                             {"GEMM_AR_SIM_RESIDENT_COMM_BLOCKS": "2"}, calls=[dict(call, out_fill=0)],
                             timeout_us=int(timeout_s * 1e6), process_timeout_s=120, **kw)
    elapsed = time.monotonic() - start
    # The resident blocks give up after one timeout; the others then start, see the abort and stop. Generous slack
    # for a loaded machine, far below a hang (the process timeout).
    assert elapsed < 4 * timeout_s + 10, f"took {elapsed:.1f} s"
    n = call["n"]
    for r in range(3):
        res = results[(0, r)]
        assert res["code"] == ERR_TIMEOUT_PREPARE and 0 <= res["peer"] < 3, f"rank {r}: {res}"
        got = _decode(np.ascontiguousarray(cases[0]["outputs"][r][:, :n]), FP16, simulator["bf16_native"])
        assert np.all(np.isnan(got)), f"rank {r}: {np.count_nonzero(~np.isnan(got))} outputs not poisoned"


def _wrong_elements(sim, dtype, world, case):
    """How many elements of rank 0's output are off the float64 reference by more than _check_call allows."""
    got = _decode(np.ascontiguousarray(case["outputs"][0][:, :case["n"]]), dtype, sim["bf16_native"])
    tol = (world + 2) * _unit_roundoff(dtype, sim["bf16_native"]) * case["magnitude"] + 1e-6
    return int(np.count_nonzero(~(np.abs(got - case["reference"]) <= tol)))


def test_two_calls_with_one_epoch_at_once_corrupt_each_other_silently(simulator, tmp_path, monkeypatch):
    # Calls 1 and 2 of one group run at the same time on every rank (two streams the host did not order) with the
    # same epoch: same tag, same window regions, so each call's flags pass for the other's and their atomic adds
    # and zeroing mix. No rank can tell: every call "succeeds", with wrong values. The same calls back to back
    # (epochs 501, 502) pass, and so does the call after the pair (the group recovers with a new epoch).
    base = dict(m=140, n=300, k=70, b_layout=B_TRANSPOSED, bias=True)
    kw = dict(world=3, dtype=FP16, compute_blocks=2, comm_blocks=2, seed=500, timeout_us=10_000_000)
    calls = [dict(base, epoch=500), dict(base, epoch=501), dict(base, epoch=502), dict(base, epoch=503)]
    cases, results, _ = _run(monkeypatch, simulator, tmp_path / "back_to_back", {}, calls=calls, **kw)
    for c, case in enumerate(cases):
        _check_call(simulator, FP16, 3, case, results, c)
    calls[2]["epoch"] = 501
    cases, results, _ = _run(monkeypatch, simulator, tmp_path / "at_once", {"GEMM_AR_SIM_CONCURRENT_CALLS": "1"},
                             calls=calls, **kw)
    for c in (0, 3):
        _check_call(simulator, FP16, 3, cases[c], results, c)
    for c in (1, 2):
        _check_clean_run(results, 3, c)  # no error code, nothing the strict models flag
    wrong = [_wrong_elements(simulator, FP16, 3, cases[c]) for c in (1, 2)]
    assert max(wrong) > 0, "two calls with one epoch at once came out right: the harness did not overlap them"
