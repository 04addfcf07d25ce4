"""The sequence-parallel kernel pairs (csrc/kernels/sp_compute_kernel.cpp, sp_comm_kernel.cpp; docs/decisions/0010-sequence-parallel-ops.md) in pto-isa's
CPU simulator with the strict data-cache and ordering models, through the same harness as tests/test_kernels_sim.py:
gemm_reduce_scatter (dim 0, RS only) and allgather_gemm (dim 0), world 2-4, back-to-back calls with fresh random
inputs and odd shapes, against a float64 reference; the call-signature agreement on the op; failures that must
poison `out`; and one negative control per fence the new kernels add (each must make the test fail).

bf16: as in test_kernels_sim.py, with g++ < 13 pto-isa's simulator stores bfloat16_t as an IEEE half."""
import numpy as np
import pytest

from error_codes import code
from test_kernels_sim import (B_ROW_MAJOR, B_TRANSPOSED, BF16, CLOBBER_FORGED_TAGS, CLOBBER_RANDOM,
                              CONTROL_TIMEOUT_US, ERR_BAD_ARGS, ERR_SIGNATURE_MISMATCH, ERR_TIMEOUT_PREPARE, FP16,
                              SP_ALLGATHER, SP_REDUCE_SCATTER, _check_control, _decode, _run_job, _unit_roundoff,
                              expect_counter, expect_silent_wrong_values, pytestmark)

__all__ = ["pytestmark"]  # the skip reason

SIG_OP = 12  # kSigOp of common/rank_agreement.h: which op the rank called
ERR_TIMEOUT_ROWS = code("kErrTimeoutRows")  # the cube waited too long for a peer's rows (allgather)


def _out_rows(op, world, m):
    return m // world if op == SP_REDUCE_SCATTER else m * world


def _expected(op, world, case, rank):
    """float64 reference and magnitudes of `rank`'s output."""
    if op == SP_REDUCE_SCATTER:
        rows = case["m"] // world
        return (case["reference"][rank * rows:(rank + 1) * rows], case["magnitude"][rank * rows:(rank + 1) * rows])
    return case["reference"], case["magnitude"]


def _check_sp_call(sim, dtype, world, case, results, call, op):
    assert results["lost_store_lines"] == 0, f"{results['lost_store_lines']} cache lines of stores never written back"
    assert results["unfenced_flags"] == 0, f"{results['unfenced_flags']} flags raised before their payload was fenced"
    assert results["unfenced_accesses"] == 0, f"{results['unfenced_accesses']} guarded accesses before an acquire fence"
    for r in range(world):
        assert results[(call, r)]["code"] == 0, f"call {call} rank {r} failed: {results[(call, r)]}"
    _check_sp_values(sim, dtype, world, case, call, op)


def _check_sp_values(sim, dtype, world, case, call, op):
    """Each rank's output within rounding of the float64 reference, nothing past column n; the allgather's outputs
    and gathered a the same on every rank."""
    n = case["n"]
    for r, raw in enumerate(case["outputs"]):
        assert raw.shape[0] == _out_rows(op, world, case["m"]), raw.shape
        assert np.all(raw[:, n:] == 0xFFFF), f"call {call}: rank {r} wrote past column n"
        got = _decode(np.ascontiguousarray(raw[:, :n]), dtype, sim["bf16_native"])
        assert np.all(np.isfinite(got)), f"call {call} rank {r}: unwritten or non-finite outputs"
        reference, magnitude = _expected(op, world, case, r)
        tol = (world + 2) * _unit_roundoff(dtype, sim["bf16_native"]) * magnitude + 1e-6
        err = np.abs(got - reference)
        worst = np.unravel_index(np.argmax(err - tol), err.shape)
        assert np.all(err <= tol), (f"call {call} rank {r} ({case['m']}x{n}x{case['k']}): |err| {err[worst]:.3g} > "
                                    f"tol {tol[worst]:.3g} at {worst}, got {got[worst]}, want {reference[worst]}")
    if op == SP_ALLGATHER:
        # Every rank computes the same tiles from the same rows: bit-identical results; the gathered a is exact.
        for r in range(1, world):
            assert np.array_equal(case["outputs"][r][:, :n], case["outputs"][0][:, :n]), f"rank {r} differs"
        want = np.vstack(case["a_vals"])
        for r in range(world):
            got = _decode(case["gathered"][r], dtype, sim["bf16_native"]).reshape(want.shape)
            assert np.array_equal(got, want), f"call {call} rank {r}: the gathered a differs from the shards"


def _run_and_check(sim, tmp_path, op, world, dtype, compute_blocks, comm_blocks, calls, seed, **kw):
    cases, results = _run_job(sim, tmp_path, world=world, dtype=dtype, compute_blocks=compute_blocks,
                              comm_blocks=comm_blocks, calls=calls, seed=seed, op=op, **kw)
    for c, case in enumerate(cases):
        _check_sp_call(sim, dtype, world, case, results, c, op)


# ---- gemm_reduce_scatter: m is every rank's full M (divisible by world), each rank gets rows r * M / world ... ----

def test_reduce_scatter_world2_fp16_odd_shapes_epoch_wrap_and_clobbered_windows(simulator, tmp_path):
    calls = [
        dict(m=202, n=300, k=300, b_layout=B_TRANSPOSED, bias=True, lda_pad=5, epoch=0xFFFFFFFE),
        dict(m=130, n=260, k=70, b_layout=B_ROW_MAJOR, bias=False, ldb_pad=3, ldo_pad=7, epoch=0xFFFFFFFF,
             clobber_after=CLOBBER_RANDOM),
        dict(m=64, n=40, k=520, b_layout=B_TRANSPOSED, bias=True, ldo_pad=2, epoch=0),
        dict(m=514, n=513, k=33, b_layout=B_ROW_MAJOR, bias=True, epoch=1),
    ]
    _run_and_check(simulator, tmp_path, SP_REDUCE_SCATTER, 2, FP16, 3, 2, calls, seed=1211)


def test_reduce_scatter_world3_bf16_late_peer_more_comm_blocks_than_queues(simulator, tmp_path):
    # Rank 1's comm kernel starts only after every other rank computed all its tiles: nobody may add into its
    # chunk before it has zeroed it for this call.
    calls = [
        dict(m=150, n=270, k=100, b_layout=B_TRANSPOSED, bias=True, epoch=7, late_rank=1, late_us=50_000),
        dict(m=303, n=100, k=260, b_layout=B_ROW_MAJOR, bias=False, lda_pad=1, epoch=8),
        dict(m=69, n=520, k=90, b_layout=B_TRANSPOSED, bias=True, ldo_pad=1, epoch=9),
    ]
    _run_and_check(simulator, tmp_path, SP_REDUCE_SCATTER, 3, BF16, 2, 3, calls, seed=1223)


def test_reduce_scatter_world4_fp16_chunks_smaller_than_a_tile_and_forged_tags(simulator, tmp_path):
    # Call 0: 4-row chunks (one partial tile each); the windows hold the next call's tag in every word between calls.
    calls = [
        dict(m=16, n=200, k=130, b_layout=B_TRANSPOSED, bias=True, epoch=1000, clobber_after=CLOBBER_FORGED_TAGS),
        dict(m=260, n=270, k=80, b_layout=B_ROW_MAJOR, bias=True, ldb_pad=2, epoch=1001,
             clobber_after=CLOBBER_FORGED_TAGS),
        dict(m=516, n=257, k=300, b_layout=B_TRANSPOSED, bias=False, lda_pad=3, epoch=1002),
    ]
    _run_and_check(simulator, tmp_path, SP_REDUCE_SCATTER, 4, FP16, 5, 2, calls, seed=1237)


# ---- allgather_gemm: m is each rank's shard, every rank gets all world * m rows ----

def test_allgather_world2_fp16_odd_shapes_epoch_wrap_and_clobbered_windows(simulator, tmp_path):
    calls = [
        dict(m=101, n=300, k=300, b_layout=B_TRANSPOSED, bias=True, lda_pad=5, epoch=0xFFFFFFFE),
        dict(m=65, n=260, k=70, b_layout=B_ROW_MAJOR, bias=False, ldb_pad=3, ldo_pad=7, epoch=0xFFFFFFFF,
             clobber_after=CLOBBER_RANDOM),
        dict(m=32, n=40, k=520, b_layout=B_TRANSPOSED, bias=True, ldo_pad=2, epoch=0),
        dict(m=257, n=513, k=33, b_layout=B_ROW_MAJOR, bias=True, epoch=1),
    ]
    _run_and_check(simulator, tmp_path, SP_ALLGATHER, 2, FP16, 3, 2, calls, seed=1249)


def test_allgather_world3_bf16_late_peer_more_comm_blocks_than_rows(simulator, tmp_path):
    # Rank 1's comm kernel starts late: its peers' compute kernels must wait (bounded) for its rows, not read
    # stale ones. Call 1 has one tile row per shard and three comm blocks (two of them pull nothing).
    calls = [
        dict(m=150, n=270, k=100, b_layout=B_TRANSPOSED, bias=True, epoch=7, late_rank=1, late_us=50_000),
        dict(m=101, n=100, k=260, b_layout=B_ROW_MAJOR, bias=False, lda_pad=1, epoch=8),
        dict(m=23, n=520, k=90, b_layout=B_TRANSPOSED, bias=True, ldo_pad=1, epoch=9),
    ]
    _run_and_check(simulator, tmp_path, SP_ALLGATHER, 3, BF16, 2, 3, calls, seed=1259)


def test_allgather_world4_fp16_forged_tags_and_shared_queues(simulator, tmp_path):
    calls = [
        dict(m=4, n=200, k=130, b_layout=B_TRANSPOSED, bias=True, epoch=1000, clobber_after=CLOBBER_FORGED_TAGS),
        dict(m=130, n=270, k=80, b_layout=B_ROW_MAJOR, bias=True, ldb_pad=2, epoch=1001,
             clobber_after=CLOBBER_FORGED_TAGS),
        dict(m=129, n=257, k=300, b_layout=B_TRANSPOSED, bias=False, lda_pad=3, epoch=1002),
    ]
    _run_and_check(simulator, tmp_path, SP_ALLGATHER, 4, FP16, 5, 2, calls, seed=1277)


# ---- agreement and failures ----

def _check_failed(sim, dtype, case, results, call, codes, peer_of, ranks):
    """Every rank in `ranks` recorded one of `codes` naming peer_of(rank); its whole output is NaN, the ldo padding
    past column n untouched (the call started from zeros: out_fill=0)."""
    assert results["lost_store_lines"] == 0 and results["unfenced_flags"] == 0
    assert results["unfenced_accesses"] == 0
    n = case["n"]
    for r in ranks:
        res = results[(call, r)]
        assert res["code"] in codes and res["peer"] == peer_of(r), f"call {call} rank {r}: {res}"
        raw = case["outputs"][r]
        got = _decode(np.ascontiguousarray(raw[:, :n]), dtype, sim["bf16_native"])
        assert np.all(np.isnan(got)), f"call {call} rank {r}: {np.count_nonzero(~np.isnan(got))} outputs not poisoned"
        assert np.all(raw[:, n:] == 0), f"call {call} rank {r}: poison written past column n"


@pytest.mark.parametrize("op", [SP_REDUCE_SCATTER, SP_ALLGATHER], ids=["reduce_scatter", "allgather"])
def test_rank_calling_another_op_stops_every_rank(simulator, tmp_path, op):
    # Call 1: rank 2's signature names another op (what a rank that called gemm_allreduce would publish). Every rank
    # stops before moving data, names the rank and the op word, and poisons its out; calls 0 and 2 are right.
    base = dict(m=141, n=300, k=70, b_layout=B_TRANSPOSED, bias=True)
    calls = [dict(base, epoch=500), dict(base, epoch=501, sig_rank=2, sig_word=SIG_OP, sig_value=0, out_fill=0),
             dict(base, epoch=502)]
    cases, results = _run_job(simulator, tmp_path, world=3, dtype=FP16, compute_blocks=2, comm_blocks=2,
                              calls=calls, seed=1301, op=op)
    _check_sp_call(simulator, FP16, 3, cases[0], results, 0, op)
    _check_failed(simulator, FP16, cases[1], results, 1, {ERR_SIGNATURE_MISMATCH}, lambda r: 2 if r != 2 else 0,
                  range(3))
    assert all(results[(1, r)]["item"] == SIG_OP for r in range(3)), results
    _check_sp_call(simulator, FP16, 3, cases[2], results, 2, op)


@pytest.mark.parametrize("op", [SP_REDUCE_SCATTER, SP_ALLGATHER], ids=["reduce_scatter", "allgather"])
def test_dead_peer_poisons_the_survivors_output(simulator, tmp_path, op):
    calls = [dict(m=132, n=270, k=60, b_layout=B_TRANSPOSED, bias=False, epoch=720, skip_rank=1, out_fill=0)]
    cases, results = _run_job(simulator, tmp_path, world=3, dtype=FP16, compute_blocks=2, comm_blocks=2,
                              calls=calls, seed=1307, timeout_us=1_500_000, op=op)
    # The comm kernel waits for rank 1's signature; the allgather's cube may give up on rank 1's rows first.
    codes = {ERR_TIMEOUT_PREPARE} | ({ERR_TIMEOUT_ROWS} if op == SP_ALLGATHER else set())
    _check_failed(simulator, FP16, cases[0], results, 0, codes, lambda r: 1, (0, 2))


@pytest.mark.parametrize("op", [SP_REDUCE_SCATTER, SP_ALLGATHER], ids=["reduce_scatter", "allgather"])
def test_rank_that_cannot_attach_poisons_its_output(simulator, tmp_path, op):
    calls = [dict(m=132, n=270, k=60, b_layout=B_ROW_MAJOR, bias=True, epoch=740, out_fill=0)]
    cases, results = _run_job(simulator, tmp_path, world=3, dtype=FP16, compute_blocks=2, comm_blocks=2,
                              calls=calls, seed=1319, timeout_us=1_500_000, topology=3, op=op)  # MESH_WRONG_CONTEXT
    _check_failed(simulator, FP16, cases[0], results, 0, {ERR_BAD_ARGS}, lambda r: -1, (1,))
    codes = {ERR_TIMEOUT_PREPARE} | ({ERR_TIMEOUT_ROWS} if op == SP_ALLGATHER else set())
    _check_failed(simulator, FP16, cases[0], results, 0, codes, lambda r: 1, (0, 2))


# ---- negative controls: each fence the sequence-parallel kernels add, removed (device_support.hpp, 40-48) ----

# Each entry: the control's code, the op it runs, and the specific failure it must show (test_kernels_sim.py
# expect_*): a missing release fence is counted by unfenced_flags, a missing acquire fence by unfenced_accesses.
SP_NEGATIVE_CONTROLS = {
    # contribution flag raised with no release fence after the atomic add
    "rs_payload_unfenced": (40, SP_REDUCE_SCATTER, expect_counter("unfenced_flags")),
    # atomic add into the owner's chunk with no acquire fence after its prepared flag
    "rs_prepared_acquire": (41, SP_REDUCE_SCATTER, expect_counter("unfenced_accesses")),
    # own chunk's subtile read with no acquire fence after its contribution flags
    "rs_contrib_acquire": (42, SP_REDUCE_SCATTER, expect_counter("unfenced_accesses")),
    # published flags raised with no release fence after the shard's stores
    "ag_publish_unfenced": (43, SP_ALLGATHER, expect_counter("unfenced_flags")),
    # a peer's shard pulled with no acquire fence after its published flag
    "ag_published_acquire": (44, SP_ALLGATHER, expect_counter("unfenced_accesses")),
    # row-ready flag raised with no release fence after the pulled rows
    "ag_pull_unfenced": (45, SP_ALLGATHER, expect_counter("unfenced_flags")),
    # gathered rows loaded by the cube with no acquire fence after their row-ready flag
    "ag_row_acquire": (46, SP_ALLGATHER, expect_counter("unfenced_accesses")),
    # the cube computes peers' rows without waiting for them -> stale rows, wrong values no rank notices (in calls
    # 1 and 2 rank 1 is late, so its rows are certainly not there yet)
    "ag_no_row_wait": (47, SP_ALLGATHER, expect_silent_wrong_values(3, (1, 2))),
    # prepared flags raised with no release fence after the owner zeroed its chunk
    "rs_zero_unfenced": (48, SP_REDUCE_SCATTER, expect_counter("unfenced_flags")),
}
# A new shape every call, the epoch through the device counter, the next call's tag in every word of windows and
# scratch between calls, and rank 1 late in calls 1 and 2 (its peers' rows and adds must wait for it).
_CONTROL_CALLS = [
    dict(m=141, n=300, k=70, b_layout=B_TRANSPOSED, bias=True, epoch=90, clobber_after=CLOBBER_FORGED_TAGS),
    dict(m=102, n=260, k=90, b_layout=B_ROW_MAJOR, bias=False, epoch=91, clobber_after=CLOBBER_FORGED_TAGS,
         late_rank=1, late_us=300_000),
    dict(m=270, n=200, k=60, b_layout=B_TRANSPOSED, bias=True, epoch=92, late_rank=1, late_us=300_000),
]


@pytest.mark.parametrize("control", sorted(SP_NEGATIVE_CONTROLS))
def test_negative_control_is_caught(simulator, tmp_path, control):
    code, op, expected = SP_NEGATIVE_CONTROLS[control]
    cases, results = _run_job(simulator, tmp_path, world=3, dtype=FP16, compute_blocks=2, comm_blocks=2,
                              calls=[dict(c, via_counter=True) for c in _CONTROL_CALLS], seed=1401,
                              timeout_us=CONTROL_TIMEOUT_US, process_timeout_s=300, negative_control=code, op=op)
    _check_control(control, expected, results, cases,
                   lambda c, case: _check_sp_call(simulator, FP16, 3, case, results, c, op),
                   lambda c, case: _check_sp_values(simulator, FP16, 3, case, c, op))


@pytest.mark.parametrize("op", [SP_REDUCE_SCATTER, SP_ALLGATHER], ids=["reduce_scatter", "allgather"])
def test_control_calls_pass_without_a_control(simulator, tmp_path, op):
    # The job the negative controls run must pass as it is (with the controls' wait bound), or a "caught" control
    # would prove nothing.
    _run_and_check(simulator, tmp_path, op, 3, FP16, 2, 2, [dict(c, via_counter=True) for c in _CONTROL_CALLS],
                   seed=1401, timeout_us=CONTROL_TIMEOUT_US)
