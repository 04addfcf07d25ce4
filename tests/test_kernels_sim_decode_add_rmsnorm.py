"""gemm_allreduce_add_rmsnorm in the decode variant (KernelArgs::variant = kVariantDecode with the add+RMSNorm
epilogue: csrc/kernels/decode_comm_block.hpp, csrc/kernels/add_rmsnorm_epilogue.hpp; docs/ascend.md, "Decode") in
pto-isa's CPU simulator with the strict data-cache and ordering models, through the same harness as
tests/test_kernels_sim.py (sim_main.cpp op 4 with an eps): every rank pushes its partial into every window (its own
too), and the block that runs the row band sums the partials in rank order, rounds, adds the residual and normalises.

World 2, 3, 4 and 8 (8 at a tiny shape), M in {1, 3, 17, 64}, odd N, bias, fp16 and bf16, back-to-back calls (epochs
across the 2^32 wrap and through the device counter, windows clobbered between calls, a late peer, the busy-device
models). Both outputs are checked against float64 references (test_kernels_sim_add_rmsnorm.py: out =
all_reduce(a @ b) + bias + residual, normed from the kernel's out and from the float64 chain) and must be bitwise
identical on every rank. A rank that
launched the other variant, and peers' flags that never arrive (the epilogue's bounded wait and stall report), stop
every rank with both outputs NaN. The negative controls put back the bugs the epilogue's waits, its fence, its rank
order and its residual add guard against: each must make its test fail.

bf16: as in test_kernels_sim.py, with g++ < 13 pto-isa's simulator stores bfloat16_t as an IEEE half."""
import numpy as np
import pytest

from error_codes import code
from test_kernels_sim import (B_ROW_MAJOR, B_TRANSPOSED, BF16, CLOBBER_FORGED_TAGS, CLOBBER_RANDOM,
                              CONTROL_TIMEOUT_US, DECODE, ERR_SIGNATURE_MISMATCH, FP16, _check_clean_run,
                              _check_control, _decode, _run_job, expect_counter, expect_errors,
                              expect_silent_wrong_values, pytestmark)
from test_kernels_sim_add_rmsnorm import EPS, _check_epilogue_call, _check_epilogue_values
from test_kernels_sim_models import ASYNC, EVICT, POSTED, _check_model_counters
from test_kernels_sim_models import _run as _run_with_model

__all__ = ["pytestmark"]  # the skip reason

# NegativeControl values of csrc/kernels/device_support.hpp that reach the decode variant's epilogue.
CONTROL_EPILOGUE_ACQUIRE = 24  # the band's partials read after their pushed flags without the acquire fence
CONTROL_EPILOGUE_NO_WAIT = 25  # the band normalised without waiting for the pushed flags
CONTROL_ARRIVAL_ORDER = 29  # partials summed own first, then in push order: another order on every rank
CONTROL_NO_RESIDUAL = 33  # the residual left out of `out` and normed
CONTROL_FLAG_UNFLUSHED = 31  # peers' pushed flags stored but never written back
ERR_TIMEOUT_REDUCE = code("kErrTimeoutReduce")  # a source's partial of tile `item` never arrived
SIG_VARIANT = 15  # the signature word the NPU host puts KernelArgs::variant in (common/rank_agreement.h kSigEngineMode)


def _run(sim, tmp_path, world, dtype, calls, seed, compute_blocks=3, comm_blocks=2, **kw):
    return _run_job(sim, tmp_path, world=world, dtype=dtype, compute_blocks=compute_blocks, comm_blocks=comm_blocks,
                    calls=[dict(c) for c in calls], seed=seed, op=DECODE, eps=EPS, epilogue=True, **kw)


def _run_and_check(sim, tmp_path, world, dtype, calls, seed, **kw):
    cases, results = _run(sim, tmp_path, world, dtype, calls, seed, **kw)
    for c, case in enumerate(cases):
        _check_epilogue_call(sim, dtype, world, case, results, c)


def test_world2_fp16_m_1_17_64_epoch_wrap_and_clobbered_windows(simulator, tmp_path):
    # N = 301 and 513: a short last column tile; N = 777: four tiles over three compute blocks.
    calls = [
        dict(m=1, n=301, k=70, b_layout=B_TRANSPOSED, bias=True, lda_pad=3, epoch=0xFFFFFFFF),
        dict(m=17, n=777, k=130, b_layout=B_ROW_MAJOR, bias=False, ldo_pad=7, epoch=0, clobber_after=CLOBBER_RANDOM),
        dict(m=64, n=513, k=65, b_layout=B_TRANSPOSED, bias=True, ldb_pad=1, epoch=1),
    ]
    _run_and_check(simulator, tmp_path, 2, FP16, calls, seed=3801)


def test_world3_bf16_late_peer(simulator, tmp_path):
    # In call 0 rank 1's comm kernel starts only once the others computed every tile (+30 ms): their epilogues wait
    # for its partials.
    calls = [
        dict(m=3, n=259, k=90, b_layout=B_TRANSPOSED, bias=True, epoch=17, late_rank=1, late_us=30_000),
        dict(m=64, n=301, k=33, b_layout=B_ROW_MAJOR, bias=True, lda_pad=1, epoch=18),
        dict(m=17, n=513, k=57, b_layout=B_TRANSPOSED, bias=False, ldo_pad=1, epoch=19),
    ]
    _run_and_check(simulator, tmp_path, 3, BF16, calls, seed=3803)


def _counter_calls():
    # Epochs through the device counter (KernelArgs::epoch stale on every rank, as in a graph replay), the next call's
    # tag in every 32-bit word of windows and scratch between calls, rank 1 late in call 0.
    return [
        dict(m=17, n=300, k=70, b_layout=B_TRANSPOSED, bias=True, epoch=90, clobber_after=CLOBBER_FORGED_TAGS,
             via_counter=True, late_rank=1, late_us=30_000),
        dict(m=1, n=257, k=40, b_layout=B_ROW_MAJOR, bias=False, epoch=91, clobber_after=CLOBBER_FORGED_TAGS,
             via_counter=True),
        dict(m=3, n=33, k=129, b_layout=B_TRANSPOSED, bias=True, ldo_pad=2, epoch=92, via_counter=True),
    ]


def test_world4_fp16_forged_tags_and_device_counter(simulator, tmp_path):
    _run_and_check(simulator, tmp_path, 4, FP16, _counter_calls(), seed=3807, compute_blocks=5)


def test_busy_device_models(simulator, tmp_path, monkeypatch):
    # Eviction of dirty lines, late write-backs and asynchronous DMA completion at once (test_kernels_sim_models.py):
    # the epilogue's loads of one source after another into the same UB tile, its stores of `out` read back in pass 2.
    model = dict(EVICT, **POSTED, **ASYNC)
    cases, results, counters = _run_with_model(
        monkeypatch, simulator, str(tmp_path), model, world=3, dtype=FP16, compute_blocks=3, comm_blocks=2,
        calls=_counter_calls(), seed=3809, op=DECODE, eps=EPS, epilogue=True)
    _check_model_counters(model, counters)
    for c, case in enumerate(cases):
        _check_epilogue_call(simulator, FP16, 3, case, results, c)


def test_world8_bf16_tiny(simulator, tmp_path):
    calls = [dict(m=3, n=33, k=40, b_layout=B_TRANSPOSED, bias=True, epoch=800),
             dict(m=1, n=17, k=16, b_layout=B_ROW_MAJOR, bias=False, ldo_pad=1, epoch=801)]
    _run_and_check(simulator, tmp_path, 8, BF16, calls, seed=3808, compute_blocks=2, comm_blocks=1)


# Cancellation (as in test_kernels_sim_decode.py): rank 1's a is exactly -(rank 0's a), 2^11 times larger than rank
# 2's. In rank order p0 + p1 is exactly 0 and the sum is p2; an order that adds p2 to p0 first loses p2's low bits,
# so ranks that sum in different orders get different bits in out, and with it in normed.
_CANCEL_MIX = [(0, 2048.0), (0, -1.0), None]
_CANCEL_CALLS = [dict(m=3, n=300, k=40, b_layout=B_TRANSPOSED, bias=False, epoch=60, a_mix=_CANCEL_MIX),
                 dict(m=64, n=257, k=24, b_layout=B_ROW_MAJOR, bias=False, epoch=61, a_mix=_CANCEL_MIX)]


def _run_cancel_job(sim, tmp_path, negative_control=0):
    return _run(sim, tmp_path, 3, FP16, _CANCEL_CALLS, seed=3811, timeout_us=CONTROL_TIMEOUT_US,
                process_timeout_s=300, negative_control=negative_control)


def test_cancelling_partials_give_every_rank_the_same_bits(simulator, tmp_path):
    cases, results = _run_cancel_job(simulator, tmp_path)
    for c, case in enumerate(cases):
        _check_epilogue_call(simulator, FP16, 3, case, results, c)


def test_negative_control_arrival_order_makes_ranks_differ(simulator, tmp_path):
    cases, results = _run_cancel_job(simulator, tmp_path, CONTROL_ARRIVAL_ORDER)
    for c, case in enumerate(cases):
        _check_clean_run(results, 3, c)  # silent: no error, nothing the models count
        for name in ("outputs", "normed"):
            first = case[name][0][:, :case["n"]]
            assert any(not np.array_equal(raw[:, :case["n"]], first) for raw in case[name][1:]), (
                f"call {c}: every rank got the same {name} although they summed in different orders")


def test_control_calls_pass_without_a_control(simulator, tmp_path):
    # The job every control below runs must pass as it is (with the controls' wait bound), or a "caught" control
    # would prove nothing.
    _run_and_check(simulator, tmp_path, 3, FP16, _counter_calls(), seed=3813, timeout_us=CONTROL_TIMEOUT_US)


NEGATIVE_CONTROLS = {
    # the band's partials read right after their pushed flags, with no acquire fence: the ordering model counts it
    "epilogue_acquire": (CONTROL_EPILOGUE_ACQUIRE, expect_counter("unfenced_accesses")),
    # the band summed and normalised without waiting for the pushed flags (in call 0 rank 1 is late, so its
    # partials are certainly not there): wrong values no rank notices
    "epilogue_no_wait": (CONTROL_EPILOGUE_NO_WAIT, expect_silent_wrong_values(3, (0,))),
    # out = the reduced rows without the residual: wrong values in every call, no rank notices
    "no_residual": (CONTROL_NO_RESIDUAL, expect_silent_wrong_values(3, (0, 1, 2))),
}


@pytest.mark.parametrize("control", sorted(NEGATIVE_CONTROLS))
def test_negative_control_is_caught(simulator, tmp_path, control):
    code, expected = NEGATIVE_CONTROLS[control]
    cases, results = _run(simulator, tmp_path, 3, FP16, _counter_calls(), seed=3813, timeout_us=CONTROL_TIMEOUT_US,
                          process_timeout_s=300, negative_control=code)
    _check_control(control, expected, results, cases,
                   lambda c, case: _check_epilogue_call(simulator, FP16, 3, case, results, c),
                   lambda c, case: _check_epilogue_values(simulator, FP16, 3, case, c))


def _both_outputs_poisoned(sim, case, ranks):
    for r in ranks:
        for name in ("outputs", "normed"):
            got = _decode(np.ascontiguousarray(case[name][r][:, :case["n"]]), FP16, sim["bf16_native"])
            assert np.all(np.isnan(got)), f"rank {r}: {name} not poisoned"


def test_unwritten_peer_flags_time_out_in_the_epilogue_and_poison_both_outputs(simulator, tmp_path):
    # Control 31: the peers' pushed flags never leave the pushing core, so the block running the band waits for them
    # until the bound, names the missing source and tile (the epilogue's stall report), and every rank's out and
    # normed are NaN.
    calls = [dict(m=3, n=300, k=70, b_layout=B_TRANSPOSED, bias=True, epoch=70, out_fill=0)]
    cases, results = _run(simulator, tmp_path, 3, FP16, calls, seed=3817, timeout_us=CONTROL_TIMEOUT_US,
                          process_timeout_s=300, negative_control=CONTROL_FLAG_UNFLUSHED)
    expect_errors({ERR_TIMEOUT_REDUCE: None}, "lost_store_lines")(results, cases, None)
    for r in range(3):
        res = results[(0, r)]
        assert res["code"] == ERR_TIMEOUT_REDUCE and res["peer"] != r and 0 <= res["item"] < 2, res
    _both_outputs_poisoned(simulator, cases[0], range(3))


def test_rank_with_the_other_variant_stops_every_rank_and_poisons_both_outputs(simulator, tmp_path):
    # Call 1: rank 2's signature says it launched the tiled variant. Every rank stops before data moves, names the
    # word, and poisons out and normed; calls 0 and 2 around it are right.
    base = dict(m=17, n=300, k=70, b_layout=B_TRANSPOSED, bias=True)
    calls = [dict(base, epoch=500), dict(base, epoch=501, sig_rank=2, sig_word=SIG_VARIANT, sig_value=0, out_fill=0),
             dict(base, epoch=502)]
    cases, results = _run(simulator, tmp_path, 3, FP16, calls, seed=3819, timeout_us=CONTROL_TIMEOUT_US)
    for c in (0, 2):
        _check_epilogue_call(simulator, FP16, 3, cases[c], results, c)
    for r in range(3):
        assert results[(1, r)]["code"] == ERR_SIGNATURE_MISMATCH and results[(1, r)]["item"] == SIG_VARIANT, (
            results[(1, r)])
    _both_outputs_poisoned(simulator, cases[1], range(3))
