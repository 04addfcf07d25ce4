"""The add+RMSNorm epilogue of gemm_allreduce's comm kernel (csrc/kernels/add_rmsnorm_epilogue.hpp; docs/decisions/0011-add-rmsnorm-epilogue.md) in
pto-isa's CPU simulator with the strict data-cache and ordering models, through the same harness as
tests/test_kernels_sim.py (sim_main.cpp op 3): world 2-4, odd M and N (not tile multiples), bias, fp16 and bf16,
back-to-back calls with fresh random inputs. Both outputs are checked against float64 references computed here
(out = all_reduce(a @ b) + bias + residual; normed = out * rsqrt(mean(out^2) + eps) * weight) and must be bitwise
identical on every rank. Negative controls 24 and 25 put back the bugs the epilogue's ordering guards against.

bf16: as in test_kernels_sim.py, with g++ < 13 pto-isa's simulator stores bfloat16_t as an IEEE half."""
import numpy as np
import pytest

from test_kernels_sim import (ADD_RMSNORM, B_ROW_MAJOR, B_TRANSPOSED, BF16, CLOBBER_FORGED_TAGS, CLOBBER_RANDOM,
                              CONTROL_TIMEOUT_US, ERR_PEER_REJECTED, ERR_SIGNATURE_MISMATCH, FP16, SP_ALLGATHER,
                              SP_REDUCE_SCATTER, _check_clean_run, _check_control, _decode, _run_job, _unit_roundoff,
                              expect_counter, expect_silent_wrong_values, pytestmark)

__all__ = ["pytestmark"]  # the skip reason

SIG_SHARD_DIM = 13  # kSigShardDim of common/rank_agreement.h: the op's parameter, eps's bits for add+RMSNorm
EPS = 1e-5


def _check_epilogue_call(sim, dtype, world, case, results, call, eps=EPS):
    _check_clean_run(results, world, call)
    _check_epilogue_values(sim, dtype, world, case, call, eps)


def _check_epilogue_values(sim, dtype, world, case, call, eps=EPS):
    """Both outputs: the same on every rank, nothing past column n, within rounding of the float64 references."""
    m, n = case["m"], case["n"]
    u = _unit_roundoff(dtype, sim["bf16_native"])
    for name in ("outputs", "normed"):
        first = case[name][0]
        for r, raw in enumerate(case[name]):
            # Every rank normalises its own copy from the same reduced bytes: bit for bit the same result.
            assert np.array_equal(raw[:, :n], first[:, :n]), f"call {call}: {name} of rank {r} differs from rank 0"
            assert np.all(raw[:, n:] == 0xFFFF), f"call {call}: rank {r} wrote {name} past column n"
    out = _decode(np.ascontiguousarray(case["outputs"][0][:, :n]), dtype, sim["bf16_native"])
    normed = _decode(np.ascontiguousarray(case["normed"][0][:, :n]), dtype, sim["bf16_native"])
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(normed)), f"call {call}: unwritten or non-finite outputs"

    # out: the reduction (rounded partials, world - 1 atomic adds, the reduced value) plus the residual, rounded.
    out_ref = case["reference"] + case["residual"]
    out_tol = (world + 2) * u * case["magnitude"] + u * np.abs(out_ref) + 1e-6
    err = np.abs(out - out_ref)
    worst = np.unravel_index(np.argmax(err - out_tol), err.shape)
    assert np.all(err <= out_tol), (f"call {call} ({m}x{n}x{case['k']}): out |err| {err[worst]:.3g} > tol "
                                    f"{out_tol[worst]:.3g} at {worst}")

    weight = case["weight"]
    # normed from the kernel's own `out`: only fp32 statistics and the final rounding stand between them.
    rstd = 1.0 / np.sqrt(np.mean(out * out, axis=1, keepdims=True) + eps)
    want = out * rstd * weight
    tol = u * np.abs(want) + 1e-5 * np.abs(want) + 1e-6
    err = np.abs(normed - want)
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert np.all(err <= tol), (f"call {call}: normed |err| {err[worst]:.3g} > tol {tol[worst]:.3g} at {worst}, "
                                f"got {normed[worst]}, want {want[worst]}")

    # normed against the independent float64 chain, with out's error carried through the statistics.
    ms_ref = np.mean(out_ref * out_ref, axis=1, keepdims=True)
    rstd_ref = 1.0 / np.sqrt(ms_ref + eps)
    ms_err = np.mean(2 * np.abs(out_ref) * out_tol + out_tol ** 2, axis=1, keepdims=True)
    rel_rstd = 0.5 * ms_err / (ms_ref + eps)
    want_ref = out_ref * rstd_ref * weight
    tol_ref = np.abs(weight) * rstd_ref * (out_tol + np.abs(out_ref) * rel_rstd) * 1.01 + u * np.abs(want_ref) + 1e-5
    err = np.abs(normed - want_ref)
    worst = np.unravel_index(np.argmax(err - tol_ref), err.shape)
    assert np.all(err <= tol_ref), (f"call {call}: normed vs the float64 chain |err| {err[worst]:.3g} > tol "
                                    f"{tol_ref[worst]:.3g} at {worst}")


def _run_and_check(sim, tmp_path, world, dtype, compute_blocks, comm_blocks, calls, seed, **kw):
    cases, results = _run_job(sim, tmp_path, world=world, dtype=dtype, compute_blocks=compute_blocks,
                              comm_blocks=comm_blocks, calls=calls, seed=seed, op=ADD_RMSNORM, eps=EPS, **kw)
    for c, case in enumerate(cases):
        _check_epilogue_call(sim, dtype, world, case, results, c)


def test_world2_fp16_odd_shapes_epoch_wrap_and_clobbered_windows(simulator, tmp_path):
    # N = 300: a 44-column last tile; N = 520: an 8-column one; N = 40: one partial tile. The epoch wraps after
    # call 0, and an "HCCL collective" overwrites windows and scratch after it.
    shapes = [(131, 300, 90, B_TRANSPOSED, dict(lda_pad=5, clobber_after=CLOBBER_RANDOM)),
              (67, 520, 70, B_ROW_MAJOR, dict(ldb_pad=3, ldo_pad=7)),
              (5, 40, 130, B_TRANSPOSED, dict(ldo_pad=2))]
    calls = [dict(m=m, n=n, k=k, b_layout=layout, bias=c != 2, epoch=(0xFFFFFFFF + c) % 2**32, **extra)
             for c, (m, n, k, layout, extra) in enumerate(shapes)]
    _run_and_check(simulator, tmp_path, 2, FP16, 3, 2, calls, seed=1301)


def test_world3_bf16_late_peer_and_more_comm_blocks_than_bands(simulator, tmp_path):
    # Rank 1's comm kernel starts only after every other rank computed all its tiles: the others' epilogues must
    # wait for its subtiles. Call 1 has two row bands for three comm blocks.
    calls = [
        dict(m=129, n=270, k=100, b_layout=B_TRANSPOSED, bias=True, epoch=7, late_rank=1, late_us=50_000),
        dict(m=77, n=513, k=60, b_layout=B_ROW_MAJOR, bias=True, lda_pad=1, epoch=8),
    ]
    _run_and_check(simulator, tmp_path, 3, BF16, 2, 3, calls, seed=1303)


def test_world4_fp16_forged_tags(simulator, tmp_path):
    calls = [
        dict(m=201, n=257, k=80, b_layout=B_ROW_MAJOR, bias=True, epoch=1000, clobber_after=CLOBBER_FORGED_TAGS),
        dict(m=63, n=777, k=50, b_layout=B_TRANSPOSED, bias=True, ldo_pad=3, epoch=1001),
    ]
    _run_and_check(simulator, tmp_path, 4, FP16, 5, 2, calls, seed=1307)


def test_world2_bf16_single_row_and_single_column(simulator, tmp_path):
    calls = [
        dict(m=1, n=301, k=40, b_layout=B_TRANSPOSED, bias=True, epoch=40),
        dict(m=65, n=1, k=33, b_layout=B_ROW_MAJOR, bias=True, ldo_pad=1, epoch=41),
    ]
    _run_and_check(simulator, tmp_path, 2, BF16, 2, 2, calls, seed=1319)


def test_rank_with_another_eps_stops_every_rank_and_poisons_both_outputs(simulator, tmp_path):
    # eps rides in the call signature: a rank that called with another one stops every rank before data moves,
    # and every rank's out and normed are NaN (out_fill 0 would show anything left unwritten).
    other_eps = np.array([2e-5]).view(np.int64)[0]
    calls = [dict(m=70, n=300, k=40, b_layout=B_TRANSPOSED, bias=True, epoch=60, out_fill=0, sig_rank=1,
                  sig_word=SIG_SHARD_DIM, sig_value=int(other_eps))]
    cases, results = _run_job(simulator, tmp_path, world=2, dtype=FP16, compute_blocks=2, comm_blocks=2,
                              calls=calls, seed=1321, op=ADD_RMSNORM, eps=EPS, timeout_us=3_000_000)
    case = cases[0]
    for r in range(2):
        assert results[(0, r)]["code"] == ERR_SIGNATURE_MISMATCH, results[(0, r)]
        for name in ("outputs", "normed"):
            got = _decode(np.ascontiguousarray(case[name][r][:, :case["n"]]), FP16, simulator["bf16_native"])
            assert np.all(np.isnan(got)), f"rank {r}: {name} not poisoned after a signature mismatch"


@pytest.mark.parametrize("op", [SP_REDUCE_SCATTER, SP_ALLGATHER], ids=["reduce_scatter", "allgather"])
def test_sequence_parallel_kernels_refuse_an_epilogue(simulator, tmp_path, op):
    # Only gemm_allreduce's comm kernel runs the epilogue: the sequence-parallel pairs, handed its arguments, reject
    # them (kernel_operands_usable) like any unusable arguments: every rank stops with "rank rejected its arguments"
    # before data moves, so neither output is touched (they keep the harness's zero fill).
    calls = [dict(m=96, n=300, k=40, b_layout=B_TRANSPOSED, bias=True, epoch=80, out_fill=0)]
    cases, results = _run_job(simulator, tmp_path, world=2, dtype=FP16, compute_blocks=2, comm_blocks=2,
                              calls=calls, seed=1331, op=op, eps=EPS, epilogue=True, timeout_us=3_000_000)
    for r in range(2):
        assert results[(0, r)]["code"] == ERR_PEER_REJECTED, results[(0, r)]
        for name in ("outputs", "normed"):
            assert np.all(cases[0][name][r] == 0), f"rank {r}: {name} written although the kernels refused the call"


# The epilogue's ordering, each guard removed in turn (csrc/kernels/device_support.hpp NegativeControl).
# Each entry: the control's code and the specific failure it must show (test_kernels_sim.py expect_*).
EPILOGUE_NEGATIVE_CONTROLS = {
    # the row band is read right after its subtiles' flags, with no acquire fence: the ordering model counts it
    "epilogue_acquire": (24, expect_counter("unfenced_accesses")),
    # the row band is normalised without waiting for its subtiles to be final: wrong values no rank notices (in
    # call 0 rank 1 starts late, so its subtiles are certainly not final on the others when their epilogue runs)
    "epilogue_no_wait": (25, expect_silent_wrong_values(3, (0,))),
}
_CONTROL_CALLS = [
    dict(m=140, n=300, k=70, b_layout=B_TRANSPOSED, bias=True, epoch=90, late_rank=1, late_us=30_000,
         clobber_after=CLOBBER_FORGED_TAGS, via_counter=True),
    dict(m=70, n=260, k=40, b_layout=B_ROW_MAJOR, bias=True, epoch=91, via_counter=True),
]


@pytest.mark.parametrize("control", sorted(EPILOGUE_NEGATIVE_CONTROLS))
def test_negative_control_is_caught(simulator, tmp_path, control):
    code, expected = EPILOGUE_NEGATIVE_CONTROLS[control]
    cases, results = _run_job(simulator, tmp_path, world=3, dtype=FP16, compute_blocks=2, comm_blocks=2,
                              calls=_CONTROL_CALLS, seed=1327, timeout_us=CONTROL_TIMEOUT_US, process_timeout_s=300,
                              negative_control=code, op=ADD_RMSNORM, eps=EPS)
    _check_control(control, expected, results, cases,
                   lambda c, case: _check_epilogue_call(simulator, FP16, 3, case, results, c),
                   lambda c, case: _check_epilogue_values(simulator, FP16, 3, case, c))


def test_control_calls_pass_without_a_control(simulator, tmp_path):
    # The job every negative control runs must pass as it is (with the controls' wait bound), or a "caught" control
    # would prove nothing.
    _run_and_check(simulator, tmp_path, 3, FP16, 2, 2, _CONTROL_CALLS, seed=1327, timeout_us=CONTROL_TIMEOUT_US)
