"""Check 2 (docs/decisions/0009-checking-npu-code-without-hardware.md): the Ascend kernels (csrc/kernels) compiled with g++ against pto-isa's CPU simulator, running
the real multi-rank protocol in one process (tests/kernels_sim/sim_main.cpp: a window buffer per rank, a thread per
block), back-to-back calls with fresh random inputs and varying odd shapes, compared with a float64 reference.

Strict by construction: every scalar GM access of the kernels (flags, queue slots, error record) runs against
csrc/kernels/sim_data_cache.hpp, a per-core non-coherent data cache (stores invisible until a dcci covers them,
stale loads until invalidated, unaligned dcci covering only up to the line's end). The negative controls at the end
run the kernels with one known bug put back (GEMM_AR_SIM_NEGATIVE_CONTROL, read by simulator builds only) and
require the test to catch it.

bf16: under g++ < 13 (g++ 12 in CI) pto-isa's simulator stores bfloat16_t as an IEEE half, so the bf16 cases run
with half's layout and rounding there (the `simulator` fixture reports it, `_encode` follows it); bf16's own layout
and rounding are exercised only with g++ >= 13."""
import os
import subprocess

import numpy as np
import pytest

from error_codes import code
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTO_ISA_ROOT = os.environ.get("PTO_ISA_ROOT")

pytestmark = pytest.mark.skipif(
    not PTO_ISA_ROOT,
    reason="PTO_ISA_ROOT is not set: this test needs a pto-isa checkout for its CPU simulator (docs/decisions/0009-checking-npu-code-without-hardware.md)",
)

FP16, BF16 = 1, 2  # gemm_ar::DTypeCode
B_ROW_MAJOR, B_TRANSPOSED = 0, 1  # gemm_ar::BLayoutCode
ERR_TIMEOUT_PREPARE = code("kErrTimeoutPrepare")  # a rank never announced the call
MESH, RING, RING_MOVED_LAYOUT = 0, 1, 2  # sim_main.cpp topology: how each rank's CommContext is built
MESH_WRONG_CONTEXT, MESH_NO_CONTEXT = 3, 4  # rank 1's context names rank 0 / rank 1 gets none
SP_REDUCE_SCATTER, SP_ALLGATHER = 1, 2  # gemm_ar::OpKind: the sequence-parallel kernel pairs (sim_main.cpp op)
ADD_RMSNORM = 3  # sim_main.cpp kSimAddRmsNorm: gemm_allreduce's pair with the add+RMSNorm epilogue
DECODE = 4  # sim_main.cpp kSimDecode: gemm_allreduce's pair in the decode variant (M <= 64)
CLOBBER_RANDOM, CLOBBER_FORGED_TAGS = 1, 2  # sim_main.cpp: after the call, windows and scratch get random bytes /
#                                             the next call's tag in every 32-bit word


def _encode(values, dtype, bf16_native):
    """float64 -> the 16-bit pattern the kernel reads, and the exactly representable float64 values it encodes."""
    if dtype == FP16 or not bf16_native:
        # Without native bfloat16 (g++ < 13), pto-isa's simulator stores bfloat16_t as a 16-bit IEEE half.
        half = values.astype(np.float16)
        return half.view(np.uint16), half.astype(np.float64)
    f32 = values.astype(np.float32)
    bits = f32.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
    return rounded, (rounded.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _decode(bits, dtype, bf16_native):
    if dtype == FP16 or not bf16_native:
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _unit_roundoff(dtype, bf16_native):
    return 2.0 ** -11 if (dtype == FP16 or not bf16_native) else 2.0 ** -8


def _run_job(sim, tmp_path, world, dtype, compute_blocks, comm_blocks, calls, seed, timeout_us=20_000_000,
             process_timeout_s=900, negative_control=0, topology=MESH, expect_exit=0, op=0, eps=1e-5,
             epilogue=None):
    """calls: dicts with m, n, k, b_layout, bias, and optional lda_pad, ldb_pad, ldo_pad, a_mix (per rank None or
    (source rank, factor): a = factor * an earlier rank's a, or its own; exact for powers of two), epoch, skip_rank,
    clobber_after, late_rank, late_us, sig_rank/sig_word/sig_value, bad_rank/bad_code, out_fill, via_counter,
    hccl_rank/hccl_us (sim_main.cpp; results["hccl_traffic_clobbered"][call] is then the bytes of that rank's window
    changed while it was "inside an HCCL collective"). op: 0 gemm_allreduce, SP_REDUCE_SCATTER (m = the full M;
    reference = the sum, each rank checks its chunk) or SP_ALLGATHER (m = each rank's shard; reference = the
    gathered product, "gathered" = the gathered a) or ADD_RMSNORM (gemm_allreduce with the epilogue, `eps`; each
    case also gets "residual" and "weight", the exact float64 values of the operands, and "normed", the second
    output per rank) or DECODE (gemm_allreduce's decode variant, m <= 64). epilogue=True attaches the epilogue's arguments to another op's kernels (default: only for
    ADD_RMSNORM). Returns (per call: inputs + float64 reference + outputs per rank, result lines)."""
    epilogue = op == ADD_RMSNORM if epilogue is None else epilogue
    rng = np.random.default_rng(seed)
    job_dir = str(tmp_path)
    op_field = f"{op} {eps!r}" if epilogue else f"{op}"
    lines = [f"{world} {compute_blocks} {comm_blocks} {dtype} {timeout_us} 4096 {seed} {topology} {op_field}",
             f"calls {len(calls)}"]
    cases = []
    for c, spec in enumerate(calls):
        m, n, k = spec["m"], spec["n"], spec["k"]
        lda = k + spec.get("lda_pad", 0)
        ldo = n + spec.get("ldo_pad", 0)
        transposed = spec["b_layout"] == B_TRANSPOSED
        ldb = (k if transposed else n) + spec.get("ldb_pad", 0)
        a_vals, a_full = [], []
        for r in range(world):
            a = rng.uniform(-1.0, 1.0, size=(m, lda))
            mix = spec.get("a_mix", [None] * world)[r]
            if mix is not None:  # (source rank, factor): factor * that rank's a (an earlier rank's, or its own)
                a = (a if mix[0] == r else a_full[mix[0]]) * mix[1]
            bits, vals = _encode(a, dtype, sim["bf16_native"])
            bits.tofile(os.path.join(job_dir, f"c{c}_a{r}.bin"))
            a_full.append(vals)
            a_vals.append(vals[:, :k])
        b_mem = rng.uniform(-1.0, 1.0, size=(n, ldb) if transposed else (k, ldb))
        bits, vals = _encode(b_mem, dtype, sim["bf16_native"])
        bits.tofile(os.path.join(job_dir, f"c{c}_b.bin"))
        b = vals[:, :k].T if transposed else vals[:, :n]
        bias = None
        if spec["bias"]:
            bias = rng.uniform(-1.0, 1.0, size=n).astype(np.float32)
            bias.tofile(os.path.join(job_dir, f"c{c}_bias.bin"))
        if op == SP_ALLGATHER:
            stacked = np.vstack(a_vals)
            reference, magnitude = stacked @ b, np.abs(stacked) @ np.abs(b)
        else:
            reference = sum(a_r @ b for a_r in a_vals)
            magnitude = sum(np.abs(a_r) @ np.abs(b) for a_r in a_vals)
        if bias is not None:
            reference = reference + bias.astype(np.float64)
            magnitude = magnitude + np.abs(bias.astype(np.float64))
        epilogue_inputs = {}
        if epilogue:
            # The same residual stream on every rank (one file); ldo padding covers its row stride too.
            bits, vals = _encode(rng.uniform(-1.0, 1.0, size=(m, ldo)), dtype, sim["bf16_native"])
            bits.tofile(os.path.join(job_dir, f"c{c}_residual.bin"))
            epilogue_inputs["residual"] = vals[:, :n]
            bits, vals = _encode(rng.uniform(0.5, 1.5, size=n), dtype, sim["bf16_native"])
            bits.tofile(os.path.join(job_dir, f"c{c}_weight.bin"))
            epilogue_inputs["weight"] = vals
        epoch = spec.get("epoch", c + 1)
        lines.append(f"{m} {n} {k} {spec['b_layout']} {int(bias is not None)} {lda} {ldb} {ldo} {epoch} "
                     f"{spec.get('skip_rank', -1)} {int(spec.get('clobber_after', 0))} "
                     f"{spec.get('late_rank', -1)} {spec.get('late_us', 0)} "
                     f"{spec.get('sig_rank', -1)} {spec.get('sig_word', -1)} {spec.get('sig_value', 0)} "
                     f"{spec.get('bad_rank', -1)} {spec.get('bad_code', 0)} {spec.get('out_fill', 255)} "
                     f"{int(spec.get('via_counter', False))} "
                     f"{spec.get('hccl_rank', -1)} {spec.get('hccl_us', 0)}")
        cases.append(dict(spec, ldo=ldo, reference=reference, magnitude=magnitude, a_vals=a_vals, **epilogue_inputs))
    with open(os.path.join(job_dir, "job.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    # The kernels bound their own waits; pto-isa's TWAIT must not give up silently underneath (docs/decisions/0009-checking-npu-code-without-hardware.md).
    # GEMM_AR_SIM_NEGATIVE_CONTROL: the NegativeControl of csrc/kernels/device_support.hpp this run puts back.
    env = dict(os.environ, PTO_CPU_SIM_TWAIT_MAX_SPINS="0", GEMM_AR_SIM_NEGATIVE_CONTROL=str(negative_control))
    proc = subprocess.run([sim["binary"], "run", job_dir], capture_output=True, text=True, timeout=process_timeout_s,
                          env=env)
    assert proc.returncode == expect_exit, proc.stderr + proc.stdout
    if expect_exit != 0:
        return proc.stdout, None
    if os.environ.get("GEMM_AR_SIM_REPORT_LOST"):  # debugging aid: which lines lost stores (sim_data_cache.hpp)
        print(proc.stderr)
    results = {}
    for line in proc.stdout.splitlines():
        fields = line.split()
        if fields and fields[0] in ("lost_store_lines", "unfenced_flags", "unfenced_accesses",
                                    "sync_waits_without_set", "sync_sets_unwaited"):
            results[fields[0]] = int(fields[1])
        if fields and fields[0] == "hccl_traffic_clobbered":
            results.setdefault(fields[0], {})[int(fields[1])] = int(fields[3])
        if fields and fields[0] == "result":
            call, rank, code, peer, item, block = map(int, fields[1:])
            results[(call, rank)] = dict(code=code, peer=peer, item=item, block=block)
    for c, case in enumerate(cases):
        case["outputs"] = []
        for r in range(world):
            raw = np.fromfile(os.path.join(job_dir, f"c{c}_out{r}.bin"), dtype=np.uint16)
            case["outputs"].append(raw.reshape(-1, case["ldo"]))  # rows: m, or the op's chunk / gathered rows
        if epilogue:
            case["normed"] = [np.fromfile(os.path.join(job_dir, f"c{c}_normed{r}.bin"), dtype=np.uint16)
                              .reshape(-1, case["ldo"]) for r in range(world)]
        if op == SP_ALLGATHER:
            case["gathered"] = [np.fromfile(os.path.join(job_dir, f"c{c}_gathered{r}.bin"), dtype=np.uint16)
                                for r in range(world)]
    return cases, results


def _check_clean_run(results, world, call):
    """What every successful call must show besides its values: the strict models saw nothing, no rank failed."""
    # A scalar store no dcci ever covered: a flag or record the other cores could never see.
    assert results["lost_store_lines"] == 0, f"{results['lost_store_lines']} cache lines of stores never written back"
    # A flag raised after a payload store with no release fence in between: a peer could see the flag first.
    assert results["unfenced_flags"] == 0, f"{results['unfenced_flags']} flags raised before their payload was fenced"
    # A flag-guarded load or store with no acquire fence after the flag: it could run ahead of the flag.
    assert results["unfenced_accesses"] == 0, f"{results['unfenced_accesses']} guarded accesses before an acquire fence"
    # Pipe events out of balance: a wait with no set hangs the device; a set never waited for confuses the next kernel.
    assert results["sync_waits_without_set"] == 0 and results["sync_sets_unwaited"] == 0, (
        f"pipe events: {results['sync_waits_without_set']} waits without a set, "
        f"{results['sync_sets_unwaited']} sets never waited for")
    for r in range(world):
        assert results[(call, r)]["code"] == 0, f"call {call} rank {r} failed: {results[(call, r)]}"


def _check_call(sim, dtype, world, case, results, call):
    _check_clean_run(results, world, call)
    _check_values(sim, dtype, world, case, call)


def _check_values(sim, dtype, world, case, call):
    """The call's outputs: the same on every rank, nothing past column n, within rounding of the reference."""
    m, n = case["m"], case["n"]
    first = case["outputs"][0]
    for r, raw in enumerate(case["outputs"]):
        # Identical on every rank, bit for bit: every rank copies the owner's reduced subtile.
        assert np.array_equal(raw[:, :n], first[:, :n]), f"call {call}: rank {r} differs from rank 0"
        # Nothing written past column n of `out` (ldo padding keeps the NaN pattern the harness put there).
        assert np.all(raw[:, n:] == 0xFFFF), f"call {call}: rank {r} wrote past column n"
    got = _decode(np.ascontiguousarray(first[:, :n]), dtype, sim["bf16_native"])
    assert np.all(np.isfinite(got)), f"call {call}: unwritten or non-finite outputs"
    # Rounding of each rank's partial, of world - 1 atomic adds and of the result, on the magnitudes involved.
    tol = (world + 2) * _unit_roundoff(dtype, sim["bf16_native"]) * case["magnitude"] + 1e-6
    err = np.abs(got - case["reference"])
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert np.all(err <= tol), (f"call {call} ({m}x{n}x{case['k']}): |err| {err[worst]:.3g} > tol {tol[worst]:.3g} "
                                f"at {worst}, got {got[worst]}, want {case['reference'][worst]}")


def test_world2_fp16_back_to_back_odd_shapes_and_clobbered_windows(simulator, tmp_path):
    # Epochs run across the 2^32 wrap; an "HCCL collective" overwrites windows and scratch after call 1.
    calls = [
        dict(m=200, n=300, k=300, b_layout=B_TRANSPOSED, bias=True, lda_pad=5, epoch=0xFFFFFFFE),
        dict(m=130, n=260, k=70, b_layout=B_ROW_MAJOR, bias=False, ldb_pad=3, ldo_pad=7, epoch=0xFFFFFFFF,
             clobber_after=CLOBBER_RANDOM),
        dict(m=64, n=40, k=520, b_layout=B_TRANSPOSED, bias=True, ldo_pad=2, epoch=0),
        dict(m=257, n=513, k=33, b_layout=B_ROW_MAJOR, bias=True, epoch=1),
    ]
    cases, results = _run_job(simulator, tmp_path, world=2, dtype=FP16, compute_blocks=3, comm_blocks=2,
                              calls=calls, seed=11)
    for c, case in enumerate(cases):
        _check_call(simulator, FP16, 2, case, results, c)


def test_world3_bf16_more_comm_blocks_than_queues_and_a_late_peer(simulator, tmp_path):
    # In call 0 rank 1's comm kernel starts only after every other rank has computed all its tiles (+50 ms): they
    # must not add into rank 1's subtiles before rank 1 has zeroed them for this call.
    calls = [
        dict(m=150, n=270, k=100, b_layout=B_TRANSPOSED, bias=True, epoch=7, late_rank=1, late_us=50_000),
        dict(m=300, n=100, k=260, b_layout=B_ROW_MAJOR, bias=False, lda_pad=1, epoch=8),
        dict(m=70, n=520, k=90, b_layout=B_TRANSPOSED, bias=True, ldo_pad=1, epoch=9),
    ]
    cases, results = _run_job(simulator, tmp_path, world=3, dtype=BF16, compute_blocks=2, comm_blocks=3,
                              calls=calls, seed=23)
    for c, case in enumerate(cases):
        _check_call(simulator, BF16, 3, case, results, c)


def test_world4_fp16_fewer_tiles_than_ranks_and_shared_queues(simulator, tmp_path):
    # Call 0 has one tile (ranks 1..3 own nothing); P=5 queues over Q=2 comm blocks.
    calls = [
        dict(m=100, n=200, k=130, b_layout=B_TRANSPOSED, bias=True, epoch=1000),
        dict(m=260, n=270, k=80, b_layout=B_ROW_MAJOR, bias=True, ldb_pad=2, epoch=1001,
             clobber_after=CLOBBER_RANDOM),
        dict(m=129, n=257, k=300, b_layout=B_TRANSPOSED, bias=False, lda_pad=3, epoch=1002),
    ]
    cases, results = _run_job(simulator, tmp_path, world=4, dtype=FP16, compute_blocks=5, comm_blocks=2,
                              calls=calls, seed=37)
    for c, case in enumerate(cases):
        _check_call(simulator, FP16, 4, case, results, c)


def test_dead_peer_turns_into_an_error_naming_it(simulator, tmp_path):
    # Rank 2 never launches call 1: the survivors must give up after the timeout (3 s without progress, well above
    # what a simulated tile takes on a loaded machine) and name rank 2, not hang.
    calls = [
        dict(m=140, n=260, k=70, b_layout=B_TRANSPOSED, bias=False, epoch=50),
        dict(m=140, n=260, k=70, b_layout=B_TRANSPOSED, bias=False, epoch=51, skip_rank=2),
    ]
    cases, results = _run_job(simulator, tmp_path, world=3, dtype=FP16, compute_blocks=2, comm_blocks=2,
                              calls=calls, seed=41, timeout_us=3_000_000)
    _check_call(simulator, FP16, 3, cases[0], results, 0)
    for r in (0, 1):
        res = results[(1, r)]
        assert res["code"] == ERR_TIMEOUT_PREPARE, f"rank {r}: expected a timeout waiting for rank 2, got {res}"
        assert res["peer"] == 2, f"rank {r}: the error should name rank 2, got {res}"


def test_stress_many_back_to_back_calls_with_random_shapes(simulator, tmp_path):
    # Fresh inputs and a new random shape every call (1x1x1 included), no barrier between calls; every fourth call
    # is followed by an "HCCL collective" that overwrites windows and scratch.
    rng = np.random.default_rng(2024)
    calls = [dict(m=1, n=1, k=1, b_layout=B_ROW_MAJOR, bias=True)]
    for _ in range(13):
        calls.append(dict(m=int(rng.integers(1, 300)), n=int(rng.integers(1, 600)), k=int(rng.integers(1, 300)),
                          b_layout=int(rng.integers(0, 2)), bias=bool(rng.integers(0, 2)),
                          lda_pad=int(rng.integers(0, 4)), ldb_pad=int(rng.integers(0, 4)),
                          ldo_pad=int(rng.integers(0, 4))))
    first_epoch = int(rng.integers(0, 2 ** 32))
    for c, spec in enumerate(calls):
        spec["epoch"] = (first_epoch + c) % 2 ** 32
        spec["clobber_after"] = CLOBBER_RANDOM if c % 4 == 3 else 0
    cases, results = _run_job(simulator, tmp_path, world=3, dtype=FP16, compute_blocks=3, comm_blocks=2,
                              calls=calls, seed=99)
    for c, case in enumerate(cases):
        _check_call(simulator, FP16, 3, case, results, c)


def test_world1_is_a_plain_matmul(simulator, tmp_path):
    # The op does not launch the kernels for one rank, but they must still be right there (no peers to wait for).
    calls = [dict(m=77, n=300, k=150, b_layout=B_TRANSPOSED, bias=True, epoch=3),
             dict(m=129, n=33, k=257, b_layout=B_ROW_MAJOR, bias=False, epoch=4)]
    cases, results = _run_job(simulator, tmp_path, world=1, dtype=FP16, compute_blocks=2, comm_blocks=2,
                              calls=calls, seed=5)
    for c, case in enumerate(cases):
        _check_call(simulator, FP16, 1, case, results, c)


def test_world2_bf16_both_b_layouts_bias_and_odd_tails(simulator, tmp_path):
    # bf16 with M, N and K all off the 128/256/64 tiles (and K past one 256 panel), bias on and off, both b layouts.
    calls = [
        dict(m=131, n=259, k=321, b_layout=B_ROW_MAJOR, bias=True, ldb_pad=1, epoch=70),
        dict(m=131, n=259, k=321, b_layout=B_TRANSPOSED, bias=True, lda_pad=2, epoch=71),
        dict(m=3, n=17, k=65, b_layout=B_TRANSPOSED, bias=False, ldo_pad=3, epoch=72),
        dict(m=129, n=511, k=7, b_layout=B_ROW_MAJOR, bias=False, epoch=73),
    ]
    cases, results = _run_job(simulator, tmp_path, world=2, dtype=BF16, compute_blocks=3, comm_blocks=2,
                              calls=calls, seed=71)
    for c, case in enumerate(cases):
        _check_call(simulator, BF16, 2, case, results, c)


@pytest.mark.parametrize("world", [5, 8])
def test_large_worlds_at_a_small_shape(simulator, tmp_path, world):
    # Every rank owns a few subtiles at most; rank count past what the other cases use (kMaxWorld is 8).
    calls = [dict(m=140, n=300, k=90, b_layout=B_TRANSPOSED, bias=True, epoch=200),
             dict(m=70, n=520, k=40, b_layout=B_ROW_MAJOR, bias=False, ldo_pad=1, epoch=201)]
    cases, results = _run_job(simulator, tmp_path, world=world, dtype=FP16, compute_blocks=2, comm_blocks=2,
                              calls=calls, seed=300 + world)
    for c, case in enumerate(cases):
        _check_call(simulator, FP16, world, case, results, c)


# The calls the negative controls and the forged-flag case run: the windows and scratch hold the next call's tag in
# every 32-bit word before calls 1 and 2 (data that forges a single-word flag).
_FORGED_CALLS = [
    dict(m=140, n=300, k=70, b_layout=B_TRANSPOSED, bias=True, epoch=90, clobber_after=CLOBBER_FORGED_TAGS),
    dict(m=140, n=300, k=70, b_layout=B_ROW_MAJOR, bias=False, epoch=91, clobber_after=CLOBBER_FORGED_TAGS),
    dict(m=140, n=300, k=70, b_layout=B_TRANSPOSED, bias=True, epoch=92),
]


def test_flags_are_not_forged_by_data_equal_to_the_tag(simulator, tmp_path):
    cases, results = _run_job(simulator, tmp_path, world=3, dtype=FP16, compute_blocks=2, comm_blocks=2,
                              calls=[dict(c) for c in _FORGED_CALLS], seed=91)
    for c, case in enumerate(cases):
        _check_call(simulator, FP16, 3, case, results, c)


# NegativeControl codes of csrc/kernels/device_support.hpp (each run puts one bug back) and the specific failure the
# strict simulator must then show (an expect_* check below): error codes, a model's counter, or wrong values no rank
# noticed. One entry per flush/invalidate/fence site of the kernels the models observe, plus the bugs the flag and
# queue designs guard against; the sites the model cannot observe are listed in docs/ascend.md with the reason.
ERR_QUEUE_CORRUPT = code("kErrQueueCorrupt")
ERR_SIGNATURE_MISMATCH, ERR_PEER_REJECTED = code("kErrSignatureMismatch"), code("kErrPeerRejected")
TORN = -2  # kErrSignatureMismatch's item when a peer's slot stayed torn (words and complements disagree)
SIG_M, SIG_N, SIG_DTYPE, SIG_ALGORITHM = 1, 3, 4, 6  # words of the signature (common/rank_agreement.h)
# Every control run and its baseline (the same job without the control, which must pass) use this wait bound, so
# that a control's failure is never just a bound too short for the job.
CONTROL_TIMEOUT_US = 1_500_000


def expect_errors(allowed, counter=None):
    """Some rank reports an error, every reported error is in `allowed` ({code: the item it must name, or None}),
    and the model counter `counter` (when given) is > 0."""
    def check(results, cases, values):
        reported = {key: res for key, res in results.items() if isinstance(key, tuple) and res["code"] != 0}
        assert reported, "no rank reported an error"
        for (call, rank), res in reported.items():
            assert res["code"] in allowed and allowed[res["code"]] in (None, res["item"]), (
                f"call {call} rank {rank}: expected one of {allowed} (code: item), got {res}")
        if counter is not None:
            assert results[counter] > 0, f"{counter} is {results[counter]}"
    return check


def expect_counter(counter):
    """The strict model counts the bug: `counter` (lost_store_lines, unfenced_flags, unfenced_accesses) > 0."""
    def check(results, cases, values):
        assert results[counter] > 0, f"{counter} is {results[counter]}: the model did not see the bug"
    return check


def expect_silent_wrong_values(world, calls, unwritten=False):
    """No rank reports an error and the models count nothing, yet the outputs of `calls` are wrong (values(c, case)
    fails); unwritten: every element of those outputs still holds the harness's NaN fill."""
    def check(results, cases, values):
        for c in range(len(cases)):
            _check_clean_run(results, world, c)
        for c in calls:
            try:
                values(c, cases[c])
            except AssertionError:
                pass
            else:
                raise AssertionError(f"call {c}: right values")
            if unwritten:
                assert all(np.all(raw == 0xFFFF) for raw in cases[c]["outputs"]), f"call {c}: outputs written"
    return check


def _check_control(control, expected, results, cases, check, values):
    """The control's job failed check(call, case) on some call, and expected(results, cases, values) holds."""
    failures = _failed_calls(cases, check)
    assert failures, f"negative control {control!r} went unnoticed: the strict simulator would not catch this bug"
    try:
        expected(results, cases, values)
    except AssertionError as e:
        raise AssertionError(f"negative control {control!r} failed otherwise than expected: {e}\n"
                             + "\n".join(failures)) from None


NEGATIVE_CONTROLS = {
    # the tile id's line is not flushed before the slot's flag -> the consumer reads a stale id, the store is lost
    "queue_flush": (1, expect_errors({ERR_QUEUE_CORRUPT: None}, "lost_store_lines")),
    # flags are stored but never written back -> no rank sees a peer's signature flag: every rank times out there
    "drop_flush": (2, expect_errors({ERR_TIMEOUT_PREPARE: None}, "lost_store_lines")),
    # flags are polled from the core's stale cached copy -> the waits for signatures or prepared flags time out
    "drop_invalidate": (3, expect_errors({ERR_TIMEOUT_PREPARE: None})),
    # a data word equal to the tag passes as a flag -> a forged queue slot (corrupt queue) or a forged signature
    # flag over words that are no signature (torn slot); which one a rank meets first depends on timing
    "single_word_flags": (4, expect_errors({ERR_QUEUE_CORRUPT: None, ERR_SIGNATURE_MISMATCH: TORN})),
    # the signature words stay in the writer's cache -> peers read a torn slot, the stores are lost
    "signature_unflushed": (6, expect_errors({ERR_SIGNATURE_MISMATCH: TORN}, "lost_store_lines")),
    # a contribution's flag raised with no fence after its atomic add -> the ordering model counts it
    "payload_unfenced": (7, expect_counter("unfenced_flags")),
    # KernelArgs (one buffer per rank, rewritten every call) read from the previous call's cached lines -> calls
    # 1-3 run with the previous call's arguments and "succeed" without writing their own `out`
    "args_stale": (8, expect_silent_wrong_values(3, (1, 2, 3), unwritten=True)),
    # the epoch counter read from a line cached in an earlier call -> a stale tag; in call 3, the first call the
    # windows were not clobbered before, leftover flags pass for its own: wrong values no rank notices
    "counter_stale": (9, expect_silent_wrong_values(3, (3,))),
    # the queue id read from the line cached when its flag was first polled -> stale id, corrupt queue
    "queue_id_stale": (15, expect_errors({ERR_QUEUE_CORRUPT: None})),
    # a peer's signature read from the lines cached two calls ago (same slot parity, other M) -> calls 2 and 3 stop
    # on a mismatch in M
    "signature_stale": (17, expect_errors({ERR_SIGNATURE_MISMATCH: SIG_M})),
    # each acquire_fence() after a flag was seen, removed: the ordering model counts the guarded access after it
    "queue_acquire": (19, expect_counter("unfenced_accesses")),
    "signature_acquire": (20, expect_counter("unfenced_accesses")),
    "prepared_acquire": (21, expect_counter("unfenced_accesses")),
    "contrib_acquire": (22, expect_counter("unfenced_accesses")),
    "arrival_acquire": (23, expect_counter("unfenced_accesses")),
}
# Each control's calls: a new shape (hence a new signature) every call, the epoch through the device counter, and
# the next call's tag in every 32-bit word of windows and scratch between calls (data that forges one-word flags).
_CONTROL_CALLS = [
    dict(m=140, n=300, k=70, b_layout=B_TRANSPOSED, bias=True, epoch=90, clobber_after=CLOBBER_FORGED_TAGS),
    dict(m=100, n=260, k=90, b_layout=B_ROW_MAJOR, bias=False, epoch=91, clobber_after=CLOBBER_FORGED_TAGS),
    dict(m=130, n=200, k=60, b_layout=B_TRANSPOSED, bias=True, epoch=92),
    dict(m=70, n=300, k=40, b_layout=B_ROW_MAJOR, bias=False, epoch=93),
]


def _failed_calls(cases, check):
    """The first line of every call's failed check(call, case): what a negative control must produce."""
    failures = []
    for c, case in enumerate(cases):
        try:
            check(c, case)
        except AssertionError as e:
            failures.append(f"call {c}: {str(e).splitlines()[0]}")
    return failures


def _run_control_job(sim, tmp_path, negative_control):
    return _run_job(sim, tmp_path, world=3, dtype=FP16, compute_blocks=2, comm_blocks=2,
                    calls=[dict(c, via_counter=True) for c in _CONTROL_CALLS], seed=91,
                    timeout_us=CONTROL_TIMEOUT_US, process_timeout_s=300, negative_control=negative_control)


@pytest.mark.parametrize("control", sorted(NEGATIVE_CONTROLS))
def test_negative_control_is_caught(simulator, tmp_path, control):
    code, expected = NEGATIVE_CONTROLS[control]
    sim = simulator
    cases, results = _run_control_job(sim, tmp_path, code)
    _check_control(control, expected, results, cases,
                   lambda c, case: _check_call(sim, FP16, 3, case, results, c),
                   lambda c, case: _check_values(sim, FP16, 3, case, c))


def test_control_calls_pass_without_a_control(simulator, tmp_path):
    # The job every negative control runs must pass as it is (with the controls' wait bound), or a "caught" control
    # would prove nothing.
    cases, results = _run_control_job(simulator, tmp_path, 0)
    for c, case in enumerate(cases):
        _check_call(simulator, FP16, 3, case, results, c)


# HCCL traffic (sim_main.cpp hccl_rank): in calls 1 and 2 one rank is still inside an HCCL collective when its peers
# start the call, its window full of the collective's bytes for _HCCL_US after they started. The peers must not write
# into that window before the rank's comm kernel runs; _HCCL_US is far longer than their comm kernels take to get
# to their first remote write (control 26, which pushes the signature into every peer's window, shows it).
_HCCL_US = 200_000


def _hccl_calls(world):
    return [
        dict(m=131, n=300, k=70, b_layout=B_TRANSPOSED, bias=True, lda_pad=3, epoch=40),
        dict(m=67, n=259, k=90, b_layout=B_ROW_MAJOR, bias=False, ldo_pad=5, epoch=41, hccl_rank=world - 1,
             hccl_us=_HCCL_US),
        dict(m=200, n=130, k=33, b_layout=B_TRANSPOSED, bias=True, ldb_pad=1, epoch=42, hccl_rank=0,
             hccl_us=_HCCL_US),
    ]


def _run_hccl_job(sim, tmp_path, world, negative_control=0):
    return _run_job(sim, tmp_path, world=world, dtype=FP16, compute_blocks=2, comm_blocks=2, calls=_hccl_calls(world),
                    seed=40 + world, timeout_us=CONTROL_TIMEOUT_US, process_timeout_s=300,
                    negative_control=negative_control)


@pytest.mark.parametrize("world", [2, 3])
def test_peer_still_in_an_hccl_collective_keeps_its_window(simulator, tmp_path, world):
    # The peers wait (reading only) until the rank's signature appears in its own window; nothing of the collective's
    # bytes changes meanwhile, and every call, the two with HCCL traffic included, comes out right.
    cases, results = _run_hccl_job(simulator, tmp_path, world)
    assert results["hccl_traffic_clobbered"] == {1: 0, 2: 0}, (
        f"bytes of an HCCL collective's window overwritten per call: {results['hccl_traffic_clobbered']}")
    for c, case in enumerate(cases):
        _check_call(simulator, FP16, world, case, results, c)


@pytest.mark.parametrize("world", [2, 3])
def test_negative_control_signature_push_clobbers_hccl_traffic(simulator, tmp_path, world):
    # NegativeControl 26 pushes each rank's signature into every peer's window: into the collective's bytes of the
    # rank still inside it, in both calls.
    _, results = _run_hccl_job(simulator, tmp_path, world, negative_control=26)
    clobbered = results["hccl_traffic_clobbered"]
    assert clobbered[1] > 0 and clobbered[2] > 0, f"the push went unnoticed: bytes overwritten per call {clobbered}"


# The in-kernel rank agreement and the poisoned output of a failed call.
FUSED_UNAVAILABLE = 8  # a host error code (common/call_args.h) a rank may publish in word 0


def _check_failed_call(sim, dtype, world, case, results, call, code, peer_of, ranks):
    """Every rank in `ranks` recorded `code` naming peer_of(rank), and its whole output is NaN (poison) while the
    ldo padding past column n is untouched (the call started from zeros: out_fill=0)."""
    assert results["lost_store_lines"] == 0, f"{results['lost_store_lines']} cache lines of stores never written back"
    assert results["unfenced_flags"] == 0, f"{results['unfenced_flags']} flags raised before their payload was fenced"
    # A flag-guarded load or store with no acquire fence after the flag: it could run ahead of the flag.
    assert results["unfenced_accesses"] == 0, f"{results['unfenced_accesses']} guarded accesses before an acquire fence"
    n = case["n"]
    for r in ranks:
        res = results[(call, r)]
        assert res["code"] == code, f"call {call} rank {r}: expected error {code}, got {res}"
        assert res["peer"] == peer_of(r), f"call {call} rank {r}: expected peer {peer_of(r)}, got {res}"
        raw = case["outputs"][r]
        got = _decode(np.ascontiguousarray(raw[:, :n]), dtype, sim["bf16_native"])
        assert np.all(np.isnan(got)), f"call {call} rank {r}: {np.count_nonzero(~np.isnan(got))} outputs not poisoned"
        assert np.all(raw[:, n:] == 0), f"call {call} rank {r}: poison written past column n"


@pytest.mark.parametrize("word,value", [(SIG_M, 141), (SIG_N, 301), (SIG_DTYPE, BF16), (SIG_ALGORITHM, 2)],
                         ids=["M", "N", "dtype", "algorithm"])
def test_signature_mismatch_stops_every_rank_and_poisons_out(simulator, tmp_path, word, value):
    # Call 1: rank 2 says it called with another M / N / dtype / algorithm. Every rank must stop before moving data
    # (well inside the 20 s timeout: no hang), name the rank it disagrees with, and leave NaN in out. Calls 0 and 2
    # around it (same epochs as a real group would use) must be right.
    base = dict(m=140, n=300, k=70, b_layout=B_TRANSPOSED, bias=True)
    calls = [dict(base, epoch=500), dict(base, epoch=501, sig_rank=2, sig_word=word, sig_value=value, out_fill=0),
             dict(base, epoch=502)]
    cases, results = _run_job(simulator, tmp_path, world=3, dtype=FP16, compute_blocks=2, comm_blocks=2,
                              calls=calls, seed=501)
    _check_call(simulator, FP16, 3, cases[0], results, 0)
    # Ranks 0 and 1 differ from rank 2; rank 2 differs from rank 0 (the lowest other rank).
    _check_failed_call(simulator, FP16, 3, cases[1], results, 1, ERR_SIGNATURE_MISMATCH,
                       lambda r: 2 if r != 2 else 0, range(3))
    for r in range(3):
        assert results[(1, r)]["item"] == word, f"rank {r} should name signature word {word}: {results[(1, r)]}"
    _check_call(simulator, FP16, 3, cases[2], results, 2)


def test_rank_with_bad_arguments_makes_peers_fail_fast(simulator, tmp_path):
    # Call 1: rank 1 rejected its arguments; its host launches only a signature-only comm kernel (no plan, no
    # output) and raises. Ranks 0 and 2 must stop at once with "rank 1 rejected its arguments", poison out, and the
    # group must work again in call 2.
    base = dict(m=150, n=260, k=90, b_layout=B_ROW_MAJOR, bias=False)
    calls = [dict(base, epoch=610), dict(base, epoch=611, bad_rank=1, bad_code=FUSED_UNAVAILABLE, out_fill=0),
             dict(base, epoch=612)]
    cases, results = _run_job(simulator, tmp_path, world=3, dtype=FP16, compute_blocks=2, comm_blocks=2,
                              calls=calls, seed=611)
    _check_call(simulator, FP16, 3, cases[0], results, 0)
    _check_failed_call(simulator, FP16, 3, cases[1], results, 1, ERR_PEER_REJECTED, lambda r: 1, (0, 2))
    assert results[(1, 1)]["code"] == ERR_PEER_REJECTED and results[(1, 1)]["peer"] == 1, results[(1, 1)]
    for r in range(3):
        assert results[(1, r)]["item"] == FUSED_UNAVAILABLE, results[(1, r)]
    _check_call(simulator, FP16, 3, cases[2], results, 2)


# Rank 1 never launches the call: the survivors must give up (bounded) and poison `out`. Also control 13's job.
_DEAD_PEER_CALLS = [dict(m=130, n=270, k=60, b_layout=B_TRANSPOSED, bias=False, epoch=720, skip_rank=1, out_fill=0)]


def _run_dead_peer_job(sim, tmp_path, negative_control=0):
    return _run_job(sim, tmp_path, world=3, dtype=FP16, compute_blocks=2, comm_blocks=2, calls=_DEAD_PEER_CALLS,
                    seed=720, timeout_us=CONTROL_TIMEOUT_US, process_timeout_s=300, negative_control=negative_control)


def test_dead_peer_poisons_the_survivors_output(simulator, tmp_path):
    # A timeout must leave NaN, not a half-written result, on the survivors, and name rank 1 in their records.
    cases, results = _run_dead_peer_job(simulator, tmp_path)
    _check_failed_call(simulator, FP16, 3, cases[0], results, 0, ERR_TIMEOUT_PREPARE, lambda r: 1, (0, 2))


def test_negative_control_unflushed_error_record_is_caught(simulator, tmp_path):
    # NegativeControl 13 leaves the error record's tag line dirty in the dead-peer job above: the survivors still give
    # up and poison `out`, but their records never reach memory (the host would see no error), and the model counts
    # the lost store.
    cases, results = _run_dead_peer_job(simulator, tmp_path, negative_control=13)
    assert results["lost_store_lines"] > 0, "the error record's unflushed tag went uncounted"
    for r in (0, 2):
        assert results[(0, r)]["code"] == 0, f"rank {r}: its error record reached memory: {results[(0, r)]}"
        got = _decode(np.ascontiguousarray(cases[0]["outputs"][r][:, :cases[0]["n"]]), FP16, simulator["bf16_native"])
        assert np.all(np.isnan(got)), f"rank {r}: not poisoned, so it did not give up at all"


ERR_BAD_ARGS = code("kErrBadArgs")


@pytest.mark.parametrize("topology", [MESH_WRONG_CONTEXT, MESH_NO_CONTEXT], ids=["attach_fails", "header_unusable"])
def test_rank_that_cannot_attach_poisons_its_output(simulator, tmp_path, topology):
    # Rank 1's comm kernel cannot use its device context (it names another rank, or there is none). Rank 1
    # records kErrBadArgs and still poisons its own `out`; its peers wait for its signature in vain (bounded) and
    # poison theirs.
    calls = [dict(m=130, n=270, k=60, b_layout=B_ROW_MAJOR, bias=True, epoch=740, out_fill=0)]
    cases, results = _run_job(simulator, tmp_path, world=3, dtype=FP16, compute_blocks=2, comm_blocks=2,
                              calls=calls, seed=740, timeout_us=1_500_000, topology=topology)
    _check_failed_call(simulator, FP16, 3, cases[0], results, 0, ERR_BAD_ARGS, lambda r: -1, (1,))
    _check_failed_call(simulator, FP16, 3, cases[0], results, 0, ERR_TIMEOUT_PREPARE, lambda r: 1, (0, 2))


def test_negative_control_unchecked_signatures_are_caught(simulator, tmp_path):
    # Rank 1 says it called with another M: every rank stops with kErrSignatureMismatch. NegativeControl 5 waits for
    # the peers' signatures but does not compare them: then every rank "succeeds" although the ranks disagree.
    base = dict(m=140, n=300, k=70, b_layout=B_TRANSPOSED, bias=True)
    calls = [dict(base, epoch=800, sig_rank=1, sig_word=SIG_M, sig_value=141, out_fill=0)]
    runs = {}
    for control in (0, 5):
        (tmp_path / str(control)).mkdir()
        runs[control] = _run_job(simulator, tmp_path / str(control), world=3, dtype=FP16, compute_blocks=2,
                                 comm_blocks=2, calls=calls, seed=800, timeout_us=CONTROL_TIMEOUT_US,
                                 process_timeout_s=300, negative_control=control)
    cases, results = runs[0]
    _check_failed_call(simulator, FP16, 3, cases[0], results, 0, ERR_SIGNATURE_MISMATCH,
                       lambda r: 1 if r != 1 else 0, range(3))
    _, results = runs[5]
    _check_clean_run(results, 3, 0)  # every rank went on: no error, nothing the models count


def test_epoch_from_the_device_counter_overrides_replayed_arguments(simulator, tmp_path):
    # The NPU host passes the epoch through a device counter it increments on the stream after each call, so that a
    # captured graph's replays (same KernelArgs bytes every time) still get a new epoch per call. Here every rank's
    # KernelArgs::epoch is stale and different: only the counter can make these calls agree and come out right.
    calls = [dict(m=140, n=300, k=70, b_layout=B_TRANSPOSED, bias=True, epoch=900 + c, via_counter=True)
             for c in range(3)]
    calls[1]["clobber_after"] = CLOBBER_FORGED_TAGS
    cases, results = _run_job(simulator, tmp_path, world=3, dtype=FP16, compute_blocks=2, comm_blocks=2,
                              calls=calls, seed=900, timeout_us=3_000_000)
    for c, case in enumerate(cases):
        _check_call(simulator, FP16, 3, case, results, c)


def test_ring_context_assembled_by_the_host_code(simulator, tmp_path):
    # RING (A3): each rank's CommContext comes from a fake HCCL op-resource block through the host's own
    # assemble_ring_context (csrc/host/npu/ring_context.cpp), then the kernels run on it (MESH: every other test).
    calls = [dict(m=140, n=300, k=90, b_layout=B_TRANSPOSED, bias=True, epoch=950),
             dict(m=260, n=130, k=40, b_layout=B_ROW_MAJOR, bias=False, epoch=951, clobber_after=CLOBBER_RANDOM),
             dict(m=70, n=520, k=60, b_layout=B_TRANSPOSED, bias=False, epoch=952)]
    cases, results = _run_job(simulator, tmp_path, world=4, dtype=FP16, compute_blocks=2, comm_blocks=2,
                              calls=calls, seed=950, topology=RING)
    for c, case in enumerate(cases):
        _check_call(simulator, FP16, 4, case, results, c)


def test_ring_context_with_a_moved_layout_is_refused(simulator, tmp_path):
    # Rank 1's record for rank 0 names rank 2 (what a newer HCCL with moved fields would look like): refused with a
    # message naming the record, before any kernel runs.
    stdout, _ = _run_job(simulator, tmp_path, world=3, dtype=FP16, compute_blocks=2, comm_blocks=2,
                         calls=[dict(m=64, n=64, k=64, b_layout=B_ROW_MAJOR, bias=False, epoch=960)], seed=960,
                         topology=RING_MOVED_LAYOUT, expect_exit=3)
    assert "ring_context_error" in stdout and "remoteRes[0] describes rank 2" in stdout, stdout
