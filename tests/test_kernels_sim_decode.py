"""The decode variant of gemm_allreduce's kernel pair (KernelArgs::variant = kVariantDecode,
csrc/kernels/decode_comm_block.hpp; docs/ascend.md, "Decode") in pto-isa's CPU simulator with the strict data-cache
and ordering models, through the same harness as tests/test_kernels_sim.py (sim_main.cpp op 4): the cube's partial
of M = 1..64 rows, pushed whole into every peer's window, summed by every rank in rank order.

World 2, 3, 4 and 8 (8 at a tiny shape), M in {1, 5, 64}, odd N, bias, fp16 and bf16, back-to-back calls (epochs
across the 2^32 wrap and through the device counter, windows clobbered between calls, a late peer): the outputs
within rounding of a float64 reference and bitwise identical on every rank. One job is built so that the order of
the sum shows in the bits (two ranks' partials cancel exactly, a third is small), and the negative controls put
back the bugs the variant's ordering and its rank order guard against: each must make its test fail.

bf16: as in test_kernels_sim.py, with g++ < 13 pto-isa's simulator stores bfloat16_t as an IEEE half."""
import numpy as np
import pytest

from error_codes import code
from test_kernels_sim import (B_ROW_MAJOR, B_TRANSPOSED, BF16, CLOBBER_FORGED_TAGS, CLOBBER_RANDOM,
                              CONTROL_TIMEOUT_US, DECODE, ERR_SIGNATURE_MISMATCH, FP16, _check_call, _check_clean_run,
                              _check_control, _check_failed_call, _check_values, _run_job, expect_counter,
                              expect_errors, pytestmark)
from test_kernels_sim_models import ASYNC, EVICT, POSTED, _run

__all__ = ["pytestmark"]  # the skip reason

SIG_VARIANT = 15  # the signature word the NPU host puts KernelArgs::variant in (common/rank_agreement.h kSigEngineMode)
# NegativeControl values of csrc/kernels/device_support.hpp for the decode variant.
CONTROL_PUSH_UNFENCED = 27  # pushed flags raised without the release fence after the partial's stores
CONTROL_PUSHED_ACQUIRE = 28  # peers' partials read after their flags without the acquire fence
CONTROL_ARRIVAL_ORDER = 29  # partials summed own first, then in push order: another order on every rank
CONTROL_NO_WAIT = 30  # a tile reduced without waiting for the peers' pushed flags
CONTROL_FLAG_UNFLUSHED = 31  # pushed flags stored but never written back
CONTROL_FLAG_STALE = 32  # pushed flags polled without invalidating this core's cached copy
ERR_TIMEOUT_REDUCE = code("kErrTimeoutReduce")  # a peer's partial of tile `item` never arrived


def _run_decode(sim, tmp_path, world, dtype, calls, seed, compute_blocks=3, comm_blocks=2, **kw):
    return _run_job(sim, tmp_path, world=world, dtype=dtype, compute_blocks=compute_blocks, comm_blocks=comm_blocks,
                    calls=calls, seed=seed, op=DECODE, **kw)


def _check_all(sim, dtype, world, cases, results):
    for c, case in enumerate(cases):
        _check_call(sim, dtype, world, case, results, c)


def test_world2_fp16_m_1_5_64_epoch_wrap_and_clobbered_windows(simulator, tmp_path):
    # N = 301 and 513: a short last column tile; N = 777: four tiles over three compute blocks.
    calls = [
        dict(m=1, n=301, k=70, b_layout=B_TRANSPOSED, bias=True, lda_pad=3, epoch=0xFFFFFFFF),
        dict(m=5, n=777, k=130, b_layout=B_ROW_MAJOR, bias=False, ldo_pad=7, epoch=0, clobber_after=CLOBBER_RANDOM),
        dict(m=64, n=513, k=65, b_layout=B_TRANSPOSED, bias=True, ldb_pad=1, epoch=1),
    ]
    cases, results = _run_decode(simulator, tmp_path, 2, FP16, calls, seed=3701)
    _check_all(simulator, FP16, 2, cases, results)


def test_world3_bf16_late_peer(simulator, tmp_path):
    # In call 0 rank 1's comm kernel starts only once the others computed every tile (+30 ms): they push into its
    # window and wait for its partials; it finds theirs already there.
    calls = [
        dict(m=5, n=259, k=90, b_layout=B_TRANSPOSED, bias=True, epoch=17, late_rank=1, late_us=30_000),
        dict(m=64, n=301, k=33, b_layout=B_ROW_MAJOR, bias=True, lda_pad=1, epoch=18),
        dict(m=1, n=513, k=257, b_layout=B_TRANSPOSED, bias=False, ldo_pad=1, epoch=19),
    ]
    cases, results = _run_decode(simulator, tmp_path, 3, BF16, calls, seed=3703)
    _check_all(simulator, BF16, 3, cases, results)


# World 4, epochs through the device counter (KernelArgs::epoch stale on every rank, as in a graph replay), and the
# next call's tag in every 32-bit word of windows and scratch between calls (data that forges one-word flags). Also
# the job of the negative controls' baseline, at world 3.
def _counter_calls():
    return [
        dict(m=64, n=300, k=70, b_layout=B_TRANSPOSED, bias=True, epoch=90, clobber_after=CLOBBER_FORGED_TAGS,
             via_counter=True),
        dict(m=1, n=257, k=40, b_layout=B_ROW_MAJOR, bias=False, epoch=91, clobber_after=CLOBBER_FORGED_TAGS,
             via_counter=True),
        dict(m=5, n=33, k=129, b_layout=B_TRANSPOSED, bias=True, ldo_pad=2, epoch=92, via_counter=True),
    ]


def test_world4_fp16_forged_tags_and_device_counter(simulator, tmp_path):
    cases, results = _run_decode(simulator, tmp_path, 4, FP16, _counter_calls(), seed=3707, compute_blocks=5)
    _check_all(simulator, FP16, 4, cases, results)


def test_world8_bf16_tiny(simulator, tmp_path):
    calls = [dict(m=5, n=33, k=40, b_layout=B_TRANSPOSED, bias=True, epoch=800),
             dict(m=1, n=17, k=16, b_layout=B_ROW_MAJOR, bias=False, ldo_pad=1, epoch=801)]
    cases, results = _run_decode(simulator, tmp_path, 8, BF16, calls, seed=3708, compute_blocks=2, comm_blocks=1)
    _check_all(simulator, BF16, 8, cases, results)


def test_busy_device_models(simulator, tmp_path, monkeypatch):
    # Eviction of dirty lines, late write-backs and asynchronous DMA completion at once (test_kernels_sim_models.py).
    model = dict(EVICT, **POSTED, **ASYNC)
    cases, results, _ = _run(monkeypatch, simulator, str(tmp_path), model, world=3, dtype=FP16, compute_blocks=3,
                             comm_blocks=2, calls=_counter_calls(), seed=3709, op=DECODE)
    _check_all(simulator, FP16, 3, cases, results)


# Cancellation: rank 1's a is exactly -(rank 0's a), which is 2^11 times larger than rank 2's. In rank order p0 + p1
# is exactly 0 and the result is p2; an order that adds p2 to p0 first loses p2's low bits to fp32 rounding at
# p0's magnitude, so ranks that sum in different orders get different bits. No bias: it would break the cancellation.
_CANCEL_MIX = [(0, 2048.0), (0, -1.0), None]
_CANCEL_CALLS = [dict(m=5, n=300, k=40, b_layout=B_TRANSPOSED, bias=False, epoch=60, a_mix=_CANCEL_MIX),
                 dict(m=64, n=257, k=24, b_layout=B_ROW_MAJOR, bias=False, epoch=61, a_mix=_CANCEL_MIX)]


def _run_cancel_job(sim, tmp_path, negative_control=0):
    return _run_decode(sim, tmp_path, 3, FP16, [dict(c) for c in _CANCEL_CALLS], seed=3711,
                       timeout_us=CONTROL_TIMEOUT_US, process_timeout_s=300, negative_control=negative_control)


def test_cancelling_partials_give_every_rank_the_same_bits(simulator, tmp_path):
    cases, results = _run_cancel_job(simulator, tmp_path)
    _check_all(simulator, FP16, 3, cases, results)


def test_negative_control_arrival_order_makes_ranks_differ(simulator, tmp_path):
    cases, results = _run_cancel_job(simulator, tmp_path, CONTROL_ARRIVAL_ORDER)
    for c, case in enumerate(cases):
        _check_clean_run(results, 3, c)  # silent: no error, nothing the models count
        first = case["outputs"][0][:, :case["n"]]
        assert any(not np.array_equal(raw[:, :case["n"]], first) for raw in case["outputs"][1:]), (
            f"call {c}: every rank got the same bits although they summed in different orders")


def _run_control_job(sim, tmp_path, negative_control):
    calls = [dict(c) for c in _counter_calls()]
    return _run_decode(sim, tmp_path, 3, FP16, calls, seed=3713, timeout_us=CONTROL_TIMEOUT_US,
                       process_timeout_s=300, negative_control=negative_control)


def test_control_calls_pass_without_a_control(simulator, tmp_path):
    cases, results = _run_control_job(simulator, tmp_path, 0)
    _check_all(simulator, FP16, 3, cases, results)


def _expect_silent():
    def check(results, cases, values):
        for c in range(len(cases)):
            _check_clean_run(results, 3, c)
    return check


NEGATIVE_CONTROLS = {
    # the pushed flags raised with no fence after the partial's stores into the peer's window
    "push_unfenced": (CONTROL_PUSH_UNFENCED, expect_counter("unfenced_flags")),
    # the peers' partials read after their flags with no acquire fence
    "pushed_acquire": (CONTROL_PUSHED_ACQUIRE, expect_counter("unfenced_accesses")),
    # a tile summed before the peers' partials arrived: whatever the window held (forged tags, the last call's data)
    "no_wait": (CONTROL_NO_WAIT, _expect_silent()),
}


@pytest.mark.parametrize("control", sorted(NEGATIVE_CONTROLS))
def test_negative_control_is_caught(simulator, tmp_path, control):
    code, expected = NEGATIVE_CONTROLS[control]
    cases, results = _run_control_job(simulator, tmp_path, code)
    _check_control(control, expected, results, cases,
                   lambda c, case: _check_call(simulator, FP16, 3, case, results, c),
                   lambda c, case: _check_values(simulator, FP16, 3, case, c))


# The pushed flags' own cache discipline (raise_flag's write-back, flag_raised's invalidate), on two calls of one shape:
# the same flags at the same places, so call 1 polls lines its cores cached, raised with call 0's tag, in call 0.
_FLAG_CALLS = [dict(m=5, n=300, k=70, b_layout=B_TRANSPOSED, bias=True, epoch=70),
               dict(m=5, n=300, k=70, b_layout=B_TRANSPOSED, bias=True, epoch=71)]


def _run_flag_job(sim, tmp_path, negative_control):
    return _run_decode(sim, tmp_path, 3, FP16, [dict(c) for c in _FLAG_CALLS], seed=3719,
                       timeout_us=CONTROL_TIMEOUT_US, process_timeout_s=300, negative_control=negative_control)


def test_flag_calls_pass_without_a_control(simulator, tmp_path):
    cases, results = _run_flag_job(simulator, tmp_path, 0)
    _check_all(simulator, FP16, 3, cases, results)


FLAG_CONTROLS = {
    # the flags never leave the pushing core: every rank times out waiting for a peer's partial, stores are lost
    "flag_unflushed": (CONTROL_FLAG_UNFLUSHED, expect_errors({ERR_TIMEOUT_REDUCE: None}, "lost_store_lines")),
    # call 1 reads its peers' flags from the lines cached in call 0 (call 0's tag): every rank times out there
    "flag_stale": (CONTROL_FLAG_STALE, expect_errors({ERR_TIMEOUT_REDUCE: None})),
}


@pytest.mark.parametrize("control", sorted(FLAG_CONTROLS))
def test_negative_control_on_pushed_flags_is_caught(simulator, tmp_path, control):
    code, expected = FLAG_CONTROLS[control]
    cases, results = _run_flag_job(simulator, tmp_path, code)
    _check_control(control, expected, results, cases,
                   lambda c, case: _check_call(simulator, FP16, 3, case, results, c),
                   lambda c, case: _check_values(simulator, FP16, 3, case, c))
    for r in range(3):  # call 1 fails on every rank, whatever the timing of call 0
        assert results[(1, r)]["code"] == ERR_TIMEOUT_REDUCE, results[(1, r)]


def test_rank_with_the_other_variant_stops_every_rank(simulator, tmp_path):
    # Call 1: rank 2's signature says it launched the tiled variant. Every rank stops before data moves, names the
    # word, and poisons `out`; calls 0 and 2 around it are right.
    base = dict(m=5, n=300, k=70, b_layout=B_TRANSPOSED, bias=True)
    calls = [dict(base, epoch=500), dict(base, epoch=501, sig_rank=2, sig_word=SIG_VARIANT, sig_value=0, out_fill=0),
             dict(base, epoch=502)]
    cases, results = _run_decode(simulator, tmp_path, 3, FP16, calls, seed=3717, timeout_us=CONTROL_TIMEOUT_US)
    _check_call(simulator, FP16, 3, cases[0], results, 0)
    _check_failed_call(simulator, FP16, 3, cases[1], results, 1, ERR_SIGNATURE_MISMATCH,
                       lambda r: 2 if r != 2 else 0, range(3))
    for r in range(3):
        assert results[(1, r)]["item"] == SIG_VARIANT, results[(1, r)]
    _check_call(simulator, FP16, 3, cases[2], results, 2)
