"""The NPU host code (csrc/host/npu, unchanged) run end to end on the emulated Ascend runtime
(docs/decisions/0019-emulated-npu-runtime.md): rank processes call the public API on "npu" tensors, the host code sets
up the emulated HCCL's windows, plans, uploads and launches the strict simulator's kernels on emulated streams, and
the results are compared with float64 references. Skips without PTO_ISA_ROOT (the kernels are pto-isa's simulator's)."""
import glob
import os
import re

import pytest
import torch

import inputs
import npu_emulated_ranks
from scoped_env import scoped_env

SEED = 35


def _set_env(**values):
    """Sets environment variables in this rank; returns what restores their previous values."""
    env = scoped_env(**values)
    env.__enter__()
    return lambda: env.__exit__(None, None, None)


def _unit(dtype, bf16_native):
    return 2.0 ** -11 if (dtype == torch.float16 or not bf16_native) else 2.0 ** -8


def _assert_close(out, shards, b, bias, dtype, bf16_native, what):
    """Within the rounding of each rank's partial, the world - 1 additions and the result (as the simulator test
    bounds it), on the magnitudes involved; finite everywhere."""
    world = len(shards)
    ref = inputs.reference(shards, b, bias)
    assert out.dtype == dtype and out.shape == ref.shape, f"{what}: {out.dtype} {tuple(out.shape)}"
    magnitude = sum((a.double().abs().reshape(-1, a.shape[-1]) @ b.double().abs()) for a in shards)
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    bound = (world + 2) * _unit(dtype, bf16_native) * magnitude.reshape(ref.shape) + 1e-6
    got = out.double()
    assert bool(torch.isfinite(got).all()), f"{what}: non-finite outputs (unwritten or failed)"
    err = (got - ref).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (f"{what}: {int((err > bound).sum())} elements over the bound; worst at flat "
                                        f"index {worst}: {float(err.flatten()[worst]):.4g} > "
                                        f"{float(bound.flatten()[worst]):.4g}")


def _model_clean(emu, what, before):
    """Nothing counted by the simulator's cache model since `before` (its counters then): the counters are the
    process's, and a pool's process also ran the fault tests."""
    counters = {name: value - before[name] for name, value in emu.model_counters().items()}
    assert all(v == 0 for v in counters.values()), f"{what}: the simulator's cache model counted {counters}"


def _operands(rank, world, seed, m, k, n, dtype, transposed, with_bias):
    shards = [inputs.shard(seed, r, m, k, dtype) for r in range(world)]
    b = inputs.weight(seed, k, n, dtype, transposed)
    bias = inputs.bias_vector(seed, n, dtype) if with_bias else None
    # b.t() of an [N, K] weight on the device, not copied: the kernels read it transposed.
    b_npu = b.t().contiguous().to("npu").t() if transposed else b.to("npu")
    return shards, b, bias, b_npu


def _gemm_allreduce(rank, world, library, topology, seed, m, k, n, dtype_name, transposed, with_bias, key=""):
    import torch_gemm_ar

    emu = npu_emulated_ranks.load(library)
    counted = emu.model_counters()
    group = npu_emulated_ranks.group(library, topology, key)
    dtype = getattr(torch, dtype_name)
    shards, b, bias, b_npu = _operands(rank, world, seed, m, k, n, dtype, transposed, with_bias)
    out = torch_gemm_ar.gemm_allreduce(shards[rank].to("npu"), b_npu, group,
                                       bias=None if bias is None else bias.to("npu"), algorithm="fused")
    assert out.device.type == "npu", out.device
    got = out.cpu()
    what = f"rank {rank}/{world} {topology} {dtype_name} {m}x{k}x{n} transposed={transposed} bias={with_bias}"
    _assert_close(got, shards, b, bias, dtype, emu.bf16_native(), what)
    torch_gemm_ar.check_errors()
    _model_clean(emu, what, counted)
    # This rank's own windows only (their names carry the creator's pid): other runs' leftovers are not ours.
    assert not glob.glob(f"/dev/shm/gemm_ar_emu_{os.getpid()}_*"), "a window's shared memory was left in /dev/shm"
    return inputs.digest(got)


def _skip_unrepresented(dtype_name, bf16_native):
    if dtype_name == "bfloat16" and not bf16_native:
        pytest.skip("the simulator stores bfloat16 as a 16-bit IEEE half with this compiler (g++ < 13): bf16 kernels "
                    "cannot be checked against a bf16 reference")


@pytest.mark.parametrize("world,topology", [(2, "mesh"), (3, "mesh"), (4, "mesh"), (4, "ring")])
def test_gemm_allreduce_fused_fp16(emulated_npu, world, topology):
    library, pools = emulated_npu
    digests = pools(world).run(_gemm_allreduce, library, topology, SEED + world, 129, 300, 77, "float16", False, False)
    assert len(set(digests)) == 1, "ranks returned different results"


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_allreduce_layouts_and_bias(emulated_npu, transposed, with_bias):
    library, pools = emulated_npu
    digests = pools(2).run(_gemm_allreduce, library, "mesh", SEED + 7, 67, 45, 130, "float16", transposed, with_bias)
    assert len(set(digests)) == 1, "ranks returned different results"


def _bound_check(got, ref, tol, what):
    assert bool(torch.isfinite(got).all()), f"{what}: non-finite outputs (unwritten or failed)"
    err = (got.double() - ref).abs()
    worst = int(torch.argmax(err - tol))
    assert bool((err <= tol).all()), (f"{what}: {int((err > tol).sum())} elements over the bound; worst at flat index "
                                      f"{worst}: {float(err.flatten()[worst]):.4g} > {float(tol.flatten()[worst]):.4g}")


def _sequence_parallel(rank, world, library, topology, seed, m, k, n, transposed, with_bias):
    """gemm_reduce_scatter (a row-parallel product, this rank's rows of the sum) and allgather_gemm (the gathered
    shards times b, and the gathered a itself) on one group."""
    import torch_gemm_ar

    emu = npu_emulated_ranks.load(library)
    counted = emu.model_counters()
    group = npu_emulated_ranks.group(library, topology)
    dtype = torch.float16
    u = _unit(dtype, emu.bf16_native())
    what = f"rank {rank}/{world} {topology} {m}x{k}x{n} transposed={transposed} bias={with_bias}"
    shards, b, bias, b_npu = _operands(rank, world, seed, m, k, n, dtype, transposed, with_bias)
    bias_npu = None if bias is None else bias.to("npu")

    out = torch_gemm_ar.gemm_reduce_scatter(shards[rank].to("npu"), b_npu, group, bias=bias_npu, algorithm="fused")
    rows = slice(rank * m // world, (rank + 1) * m // world)
    ref = inputs.reference(shards, b, bias)[rows]
    magnitude = sum(a.double().abs() @ b.double().abs() for a in shards)[rows]
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    _bound_check(out.cpu(), ref, (world + 2) * u * magnitude + 1e-6, f"gemm_reduce_scatter {what}")

    local = shards[rank][: m // world]  # allgather_gemm's shard: m / world rows per rank
    gathered_ref = torch.cat([s[: m // world] for s in shards])
    out, gathered = torch_gemm_ar.allgather_gemm(local.to("npu"), b_npu, group, bias=bias_npu, return_gathered=True,
                                                 algorithm="fused")
    assert torch.equal(gathered.cpu(), gathered_ref), f"allgather_gemm {what}: the gathered a differs"
    ref = inputs.reference([gathered_ref], b, bias)
    magnitude = gathered_ref.double().abs() @ b.double().abs()
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    got = out.cpu()
    _bound_check(got, ref, 3 * u * magnitude + 1e-6, f"allgather_gemm {what}")
    torch_gemm_ar.check_errors()
    _model_clean(emu, what, counted)
    assert emu.contexts_built()[topology] >= 1, f"{what}: the emulated HCCL never built a {topology} context"
    return inputs.digest(got)


@pytest.mark.parametrize("topology", ["mesh", "ring"])
def test_sequence_parallel_fused(emulated_npu, topology):
    library, pools = emulated_npu
    world = 2 if topology == "mesh" else 3
    digests = pools(world).run(_sequence_parallel, library, topology, SEED + 11, 12 * world, 70, 93, True, True)
    assert len(set(digests)) == 1, "allgather_gemm returned different results on different ranks"


def _add_rmsnorm(rank, world, library, topology, seed, m, k, n, in_place):
    import torch_gemm_ar

    emu = npu_emulated_ranks.load(library)
    counted = emu.model_counters()
    group = npu_emulated_ranks.group(library, topology)
    dtype, eps = torch.float16, 1e-5
    u = _unit(dtype, emu.bf16_native())
    what = f"rank {rank}/{world} {topology} {m}x{k}x{n} in_place={in_place}"
    shards, b, bias, b_npu = _operands(rank, world, seed, m, k, n, dtype, False, True)
    g = torch.Generator().manual_seed(seed * 31 + 5)
    residual = torch.randn(m, n, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.rand(n, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    residual_npu = residual.to("npu")
    if in_place:
        normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm_(shards[rank].to("npu"), b_npu, residual_npu,
                                                          weight.to("npu"), group, eps=eps, bias=bias.to("npu"),
                                                          algorithm="fused")
        out = residual_npu
    else:
        out, normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm(shards[rank].to("npu"), b_npu, residual_npu,
                                                               weight.to("npu"), group, eps=eps, bias=bias.to("npu"),
                                                               algorithm="fused")
        assert torch.equal(residual_npu.cpu(), residual), f"{what}: the out-of-place op changed residual"
    out, normed = out.cpu(), normed.cpu()
    out_ref = inputs.reference(shards, b, bias) + residual.double()
    magnitude = sum(a.double().abs() @ b.double().abs() for a in shards) + bias.double().abs()
    _bound_check(out, out_ref, (world + 2) * u * magnitude + u * out_ref.abs() + 1e-6, f"out {what}")
    # normed from the kernel's own out: only fp32 statistics and the final rounding between them.
    o = out.double()
    want = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    _bound_check(normed, want, u * want.abs() + 1e-5 * want.abs() + 1e-6, f"normed {what}")
    torch_gemm_ar.check_errors()
    _model_clean(emu, what, counted)
    assert emu.contexts_built()[topology] >= 1, f"{what}: the emulated HCCL never built a {topology} context"
    return inputs.digest(out) + inputs.digest(normed)


@pytest.mark.parametrize("topology", ["mesh", "ring"])
@pytest.mark.parametrize("in_place", [False, True])
def test_add_rmsnorm_fused(emulated_npu, topology, in_place):
    library, pools = emulated_npu
    digests = pools(2).run(_add_rmsnorm, library, topology, SEED + 13, 70, 64, 96, in_place)
    assert len(set(digests)) == 1, "ranks returned different results"


def _agreement_then_no_sync(rank, world, library, calls, seed):
    """The group's first fused call agrees over the process group; the calls after it agree in the kernels and ask
    the host for no synchronisation at all (counted by the emulated runtime)."""
    import torch_gemm_ar

    emu = npu_emulated_ranks.load(library)
    group = npu_emulated_ranks.group(library, "mesh", key="no-sync")
    dtype = torch.float16
    m, k, n = 65, 40, 72
    operands = []
    for c in range(calls):
        shards, b, _, b_npu = _operands(rank, world, seed + c, m, k, n, dtype, c % 2 == 1, False)
        operands.append((shards, b, shards[rank].to("npu"), b_npu))
    first = torch_gemm_ar.gemm_allreduce(operands[0][2], operands[0][3], group, algorithm="fused")
    before = emu.host_synchronisations()
    outs = [torch_gemm_ar.gemm_allreduce(a_npu, b_npu, group, algorithm="fused") for _, _, a_npu, b_npu in operands[1:]]
    asked = emu.host_synchronisations() - before
    assert asked == 0, f"rank {rank}: {asked} host synchronisations in {calls - 1} fused calls after the first"
    for c, out in enumerate([first] + outs):
        shards, b = operands[c][0], operands[c][1]
        _assert_close(out.cpu(), shards, b, None, dtype, emu.bf16_native(), f"rank {rank} call {c}")
    torch_gemm_ar.check_errors()
    return True


def test_agreement_then_calls_without_host_sync(emulated_npu):
    library, pools = emulated_npu
    assert pools(2).run(_agreement_then_no_sync, library, 6, SEED + 17) == [True, True]


def _signature_mismatch(rank, world, library, seed):
    """After the first (agreed) call, rank 1 calls with another K: the kernels compare the signatures, every rank's
    output is NaN and every rank raises; the group keeps working afterwards."""
    import torch_gemm_ar

    emu = npu_emulated_ranks.load(library)
    group = npu_emulated_ranks.group(library, "mesh", key="mismatch")
    dtype = torch.float16
    m, k, n = 33, 48, 40
    shards, b, _, b_npu = _operands(rank, world, seed, m, k, n, dtype, False, False)
    _assert_close(torch_gemm_ar.gemm_allreduce(shards[rank].to("npu"), b_npu, group, algorithm="fused").cpu(),
                  shards, b, None, dtype, emu.bf16_native(), f"rank {rank} agreed call")
    bad_k = k + 16 if rank == 1 else k
    a_bad = inputs.shard(seed + 1, rank, m, bad_k, dtype)
    b_bad = inputs.weight(seed + 1, bad_k, n, dtype, False)
    out = torch_gemm_ar.gemm_allreduce(a_bad.to("npu"), b_bad.to("npu"), group, algorithm="fused").cpu()
    nan_everywhere = bool(torch.isnan(out).all())
    try:
        torch_gemm_ar.check_errors()
        raised = ""
    except RuntimeError as error:
        raised = str(error)
    # The group still works, every rank's epochs aligned.
    _assert_close(torch_gemm_ar.gemm_allreduce(shards[rank].to("npu"), b_npu, group, algorithm="fused").cpu(),
                  shards, b, None, dtype, emu.bf16_native(), f"rank {rank} call after the mismatch")
    torch_gemm_ar.check_errors()
    return nan_everywhere, raised


def test_signature_mismatch_raises_on_every_rank(emulated_npu):
    library, pools = emulated_npu
    results = pools(2).run(_signature_mismatch, library, SEED + 19)
    for rank, (nan_everywhere, raised) in enumerate(results):
        assert nan_everywhere, f"rank {rank}: the mismatched call's output is not all NaN"
        assert raised, f"rank {rank}: check_errors() did not raise after a signature mismatch"
        assert "K" in raised or "signature" in raised.lower(), f"rank {rank}: the error does not name K: {raised}"


def _bad_settings_raise(rank, world, library):
    """What check_settings() says about each mistyped emulator setting (and that a good one passes)."""
    emu = npu_emulated_ranks.load(library)
    said = {}
    for name, text in [("GEMM_AR_EMU_CUBE_CORES", "two"), ("GEMM_AR_EMU_WAIT_S", "0"), ("HCCL_BUFFSIZE", "8MB"),
                       ("GEMM_AR_EMU_WINDOW_FILL", "zeros")]:
        restore = _set_env(**{name: text})
        try:
            emu.check_settings()
            said[name] = ""
        except ValueError as error:
            said[name] = str(error)
        finally:
            restore()
    emu.check_settings()
    return said


def test_mistyped_emulator_settings_raise_naming_them(emulated_npu):
    library, pools = emulated_npu
    for said in pools(2).run(_bad_settings_raise, library):
        for name, message in said.items():
            assert name in message, f"{name}: {message or 'accepted'}"


@pytest.mark.parametrize("dtype_name", ["bfloat16"])
def test_gemm_allreduce_bf16(emulated_npu, dtype_name):
    library, pools = emulated_npu
    bf16_native = pools(2).run(_bf16_native, library)[0]
    _skip_unrepresented(dtype_name, bf16_native)
    digests = pools(2).run(_gemm_allreduce, library, "ring", SEED + 23, 129, 300, 77, dtype_name, True, True)
    assert len(set(digests)) == 1, "ranks returned different results"


def _bf16_native(rank, world, library):
    return npu_emulated_ranks.load(library).bf16_native()


def _gemm_allreduce_shifted_window(rank, world, library, seed):
    """The correctness check of test_gemm_allreduce_fused_fp16 on a group whose context names one peer's window a
    cache line too far (the emulator's GEMM_AR_EMU_FAULT_WINDOW_SHIFT): returns what made it fail, or "" if it
    passed."""

    # The kernels give up on the flags that land in the wrong place.
    restore = _set_env(GEMM_AR_EMU_FAULT_WINDOW_SHIFT="64", TORCH_GEMM_AR_TIMEOUT_S="5")
    try:
        _gemm_allreduce(rank, world, library, "mesh", seed, 129, 300, 77, "float16", False, False, key="shifted")
        return ""
    except (AssertionError, RuntimeError) as error:
        try:  # the failure recorded for the group is reported here, not by a later test's check_errors()
            import torch_gemm_ar

            torch_gemm_ar.check_errors()
        except RuntimeError:
            pass
        return f"{type(error).__name__}: {error}"
    finally:
        restore()


def test_negative_control_window_shifted_by_a_cache_line(emulated_npu):
    library, pools = emulated_npu
    failures = pools(2).run(_gemm_allreduce_shifted_window, library, SEED + 29)
    assert any(failures), "a window a cache line off went unnoticed: the correctness test cannot see offsets"
    assert all(f == "" or "non-finite" in f or "over the bound" in f or "gemm_allreduce (fused, NPU)" in f
               for f in failures), f"failed for another reason: {failures}"


def _kernel_failure_on_one_rank(rank, world, library, seed, timeout_s=None):
    """Rank 1's kernels of one call never run (dropped by the emulated runtime, as a killed kernel): its peers' kernels
    give up on it within the bound, their output is NaN and the failure is raised by the next call on every peer and
    by check_errors(); the call after it is correct on every rank (the epochs stayed aligned)."""

    import torch_gemm_ar

    emu = npu_emulated_ranks.load(library)
    group = npu_emulated_ranks.group(library, "mesh", key="failure")
    dtype = torch.float16
    m, k, n = 40, 36, 50
    shards, b, _, b_npu = _operands(rank, world, seed, m, k, n, dtype, False, False)
    a_npu = shards[rank].to("npu")
    check = lambda out, what: _assert_close(out.cpu(), shards, b, None, dtype, emu.bf16_native(),  # noqa: E731
                                            f"rank {rank} {what}")
    check(torch_gemm_ar.gemm_allreduce(a_npu, b_npu, group, algorithm="fused"), "first call")
    restore = _set_env(TORCH_GEMM_AR_TIMEOUT_S="3")
    try:
        if rank == 1:
            emu.drop_next_launches(2)  # the call's compute and comm kernels
        failed = torch_gemm_ar.gemm_allreduce(a_npu, b_npu, group, algorithm="fused").cpu()
        raised_next = ""
        try:
            torch_gemm_ar.gemm_allreduce(a_npu, b_npu, group, algorithm="fused").cpu()
        except RuntimeError as error:
            raised_next = str(error).splitlines()[0]
        try:
            torch_gemm_ar.check_errors()
            raised_check = ""
        except RuntimeError as error:
            raised_check = str(error).splitlines()[0]
    finally:
        restore()
        emu.drop_next_launches(0)
    # `timeout_s` (a negative control's, short): the bound of the call after the failure.
    restore = _set_env(TORCH_GEMM_AR_TIMEOUT_S=timeout_s) if timeout_s else (lambda: None)
    try:
        check(torch_gemm_ar.gemm_allreduce(a_npu, b_npu, group, algorithm="fused"), "call after the failure")
        torch_gemm_ar.check_errors()
    finally:
        emu.replays_skip_counter(False)
        restore()
    return bool(torch.isnan(failed).all()), raised_next, raised_check


def test_kernel_failure_on_one_rank(emulated_npu):
    library, pools = emulated_npu
    results = pools(3).run(_kernel_failure_on_one_rank, library, SEED + 31)
    for rank in (0, 2):
        nan_everywhere, raised_next, raised_check = results[rank]
        assert nan_everywhere, f"rank {rank}: the failed call's output is not all NaN"
        assert raised_next or raised_check, f"rank {rank}: the failure was never raised"
        assert "rank 1" in raised_next + raised_check, f"rank {rank}: the error does not name rank 1: {results[rank]}"


def _two_threads_two_streams(rank, world, library, seed, calls, timeout_s=None):
    """Two threads, each on a stream of its own, call one group at once: the group orders their calls (the second
    waits for the first on the device), so every result is right. Both threads use the same inputs: the ranks may
    order the two threads' calls differently, which only the same operands make harmless."""
    import threading

    import torch_gemm_ar

    emu = npu_emulated_ranks.load(library)
    counted = emu.model_counters()
    group = npu_emulated_ranks.group(library, "mesh", key="threads")
    dtype = torch.float16
    m, k, n = 72, 50, 66
    shards, b, _, b_npu = _operands(rank, world, seed, m, k, n, dtype, True, False)
    a_npu = shards[rank].to("npu")
    torch_gemm_ar.gemm_allreduce(a_npu, b_npu, group, algorithm="fused").cpu()  # the agreed first call
    streams = [emu.new_stream(), emu.new_stream()]
    outs, errors = [[], []], []
    overlaps = emu.overlapping_kernels()

    def work(t):
        try:
            emu.set_stream(streams[t])
            for _ in range(calls):
                outs[t].append(torch_gemm_ar.gemm_allreduce(a_npu, b_npu, group, algorithm="fused"))
        except BaseException as error:  # noqa: BLE001  (re-raised below, on the rank's main thread)
            errors.append(error)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    # `timeout_s` (a negative control's, short): the kernels' wait bound while the threads call.
    restore = _set_env(TORCH_GEMM_AR_TIMEOUT_S=timeout_s) if timeout_s else (lambda: None)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        restore()
    assert not any(thread.is_alive() for thread in threads), f"rank {rank}: a calling thread hung"
    if errors:
        raise errors[0]
    emu.synchronize()
    overlaps = emu.overlapping_kernels() - overlaps
    assert overlaps == 0, f"rank {rank} thread 0/1: {overlaps} kernels of one group's calls ran at once on the device"
    for t in range(2):
        for c, out in enumerate(outs[t]):
            _assert_close(out.cpu(), shards, b, None, dtype, emu.bf16_native(), f"rank {rank} thread {t} call {c}")
    torch_gemm_ar.check_errors()
    _model_clean(emu, f"rank {rank} two threads", counted)
    return True


def test_two_threads_two_streams_one_group(emulated_npu):
    library, pools = emulated_npu
    assert pools(2).run(_two_threads_two_streams, library, SEED + 37, 3) == [True, True]


def _destroyed_and_recreated_group(rank, world, library, seed):
    """A group's fused calls, the group destroyed, a new one over the same ranks: its own communicator, windows and
    epochs, correct results."""
    import torch.distributed as dist

    import torch_gemm_ar

    emu = npu_emulated_ranks.load(library)
    dtype = torch.float16
    shards, b, _, b_npu = _operands(rank, world, seed, 31, 29, 45, dtype, False, False)
    a_npu = shards[rank].to("npu")
    for round_ in range(2):
        group = npu_emulated_ranks.group(library, "mesh", key=f"recreated-{seed}-{round_}")
        out = torch_gemm_ar.gemm_allreduce(a_npu, b_npu, group, algorithm="fused")
        _assert_close(out.cpu(), shards, b, None, dtype, emu.bf16_native(), f"rank {rank} group {round_}")
        torch_gemm_ar.check_errors()
        dist.destroy_process_group(group)
        npu_emulated_ranks.forget(group)
    return True


def test_destroyed_and_recreated_group(emulated_npu):
    library, pools = emulated_npu
    assert pools(2).run(_destroyed_and_recreated_group, library, SEED + 41) == [True, True]


def _raised_lines(failure):
    """The exception lines of the ranks' tracebacks in a RankFailure's text (not the source lines it quotes)."""
    return re.findall(r"^\w+(?:Error|Exception): .*$", failure, re.M)


def _failed_only_as(failure, marker, also=()):
    """Whether every exception the ranks raised is a wrong result of the call `marker` names (or says one of `also`),
    or a fused call's error naming a peer rank, and there is at least one."""
    lines = _raised_lines(failure)

    def expected(line):
        wrong_result = marker in line and any(
            said in line for said in ("non-finite outputs", "elements over the bound", *also))
        return wrong_result or ("gemm_allreduce (fused, NPU)" in line and re.search(r"rank \d", line) is not None)

    return bool(lines) and all(expected(line) for line in lines)


def _run_control(control, fn, *args):
    """fn on 2 ranks loading the negative control's build (tests/npu_emulated_build.py CONTROLS) in a pool of their
    own; the failure it must produce, as text ("" if it passed)."""
    from npu_emulated_build import emulated_control_path
    from rank_pool import RankFailure, RankPool

    path = emulated_control_path(control)
    pool = RankPool(2 if fn is _two_threads_two_streams else 3)
    try:
        pool.run(fn, path, *args, timeout_s=180)
        return ""
    except RankFailure as failure:
        return str(failure)
    finally:
        pool.close(force=True)


def test_negative_control_no_group_order(emulated_npu):
    """Without the per-group order, two threads' calls of one group run at once on the device: the test fails."""
    failure = _run_control("no_group_order", _two_threads_two_streams, SEED + 37, 3, "5")
    assert failure, "two streams' calls of one group ran unordered and the two-thread test did not notice"
    assert _failed_only_as(failure, " thread ", also=("ran at once on the device",)), (
        f"failed for another reason: {failure}")


def test_negative_control_raise_before_launch(emulated_npu):
    """With the failure raised before the launch (the old order), the ranks that saw it skip the call, the group's
    epochs drift apart and the call after the failure fails."""
    failure = _run_control("raise_before_launch", _kernel_failure_on_one_rank, SEED + 31, "5")
    assert failure, "a failure that shifts epochs went unnoticed by the kernel-failure test"
    assert _failed_only_as(failure, "call after the failure"), f"failed for another reason: {failure}"


DEAD_PEER_BOUND_S = 3
# Beyond the kernels' bound, what the emulator may add on a loaded 2-core machine: the simulated blocks are threads.
DEAD_PEER_SLACK_S = 12


def _dead_peer(rank, world, library, seed):
    """Rank 2 dies after the group's first call; the others' next call ends within the kernels' bound, its output
    NaN, and the failure names rank 2."""
    import os
    import time

    import torch_gemm_ar

    emu = npu_emulated_ranks.load(library)
    group = npu_emulated_ranks.group(library, "mesh", key="dead-peer")
    dtype = torch.float16
    shards, b, _, b_npu = _operands(rank, world, seed, 24, 20, 36, dtype, False, False)
    a_npu = shards[rank].to("npu")
    _assert_close(torch_gemm_ar.gemm_allreduce(a_npu, b_npu, group, algorithm="fused").cpu(), shards, b, None, dtype,
                  emu.bf16_native(), f"rank {rank} first call")
    torch_gemm_ar.check_errors()
    group.barrier()  # every rank saw the first call through before rank 2 goes
    if rank == 2:
        os._exit(0)
    restore = _set_env(TORCH_GEMM_AR_TIMEOUT_S=str(DEAD_PEER_BOUND_S))
    try:
        start = time.monotonic()
        out = torch_gemm_ar.gemm_allreduce(a_npu, b_npu, group, algorithm="fused").cpu()
        try:
            torch_gemm_ar.check_errors()
            raised = ""
        except RuntimeError as error:
            raised = str(error).splitlines()[0]
        took = time.monotonic() - start
    finally:
        restore()
    return bool(torch.isnan(out).all()), raised, took


def test_dead_peer_named_within_the_bound(emulated_npu):
    from rank_pool import RankPool

    library, _ = emulated_npu
    pool = RankPool(3)
    try:
        results = pool.run(_dead_peer, library, SEED + 43, tolerate_deaths=True, timeout_s=120)
    finally:
        pool.close(force=True)
    assert results[2] is None, "rank 2 was meant to die"
    for rank in (0, 1):
        nan_everywhere, raised, took = results[rank]
        assert nan_everywhere, f"rank {rank}: the call without rank 2 did not leave NaN"
        assert "rank 2" in raised, f"rank {rank}: the failure does not name the dead rank: {raised!r}"
        assert took < DEAD_PEER_BOUND_S + DEAD_PEER_SLACK_S, (
            f"rank {rank}: the call and the error took {took:.1f} s, beyond the {DEAD_PEER_BOUND_S} s bound")


def _captured_replays(rank, world, library, seed, replays, skip_counter=False):
    """A captured sequence of fused calls (two gemm_allreduce shapes, one with bias, and a gemm_reduce_scatter)
    replayed `replays` times with new inputs written in place before each replay: every replay is correct on every
    rank, which needs a fresh epoch each time (the replays repeat the KernelArgs bytes; the kernels take the epoch from
    the device counter the replay increments). Then rank 1's kernels of one replay are dropped: the peer's output of
    that call is NaN and check_errors() names rank 1; the replay after it is correct again. `skip_counter`: the
    negative control, replays without their counter increments (emu.replays_skip_counter)."""

    import torch_gemm_ar

    emu = npu_emulated_ranks.load(library)
    counted = emu.model_counters()
    group = npu_emulated_ranks.group(library, "mesh", key="graph")
    dtype = torch.float16
    u = _unit(dtype, emu.bf16_native())
    shapes = [(37, 45, 70, False, False), (50, 30, 33, True, True)]  # m, k, n, transposed, bias
    rs_m, rs_k, rs_n = 6 * world, 40, 36
    ops = []
    for i, (m, k, n, transposed, with_bias) in enumerate(shapes):
        shards, b, bias, b_npu = _operands(rank, world, seed + i, m, k, n, dtype, transposed, with_bias)
        ops.append((shards[rank].to("npu"), b, b_npu, bias, None if bias is None else bias.to("npu")))
    rs_shards, rs_b, _, rs_b_npu = _operands(rank, world, seed + 9, rs_m, rs_k, rs_n, dtype, False, False)
    rs_a = rs_shards[rank].to("npu")

    def queue_calls():
        outs = [torch_gemm_ar.gemm_allreduce(a, b_npu, group, bias=bias_npu, algorithm="fused")
                for a, _, b_npu, _, bias_npu in ops]
        return outs + [torch_gemm_ar.gemm_reduce_scatter(rs_a, rs_b_npu, group, algorithm="fused")]

    def check(outs, replay, what):
        for i, (m, k, n, _, _) in enumerate(shapes):
            shards = [inputs.shard(seed + 100 * replay + i, r, m, k, dtype) for r in range(world)]
            _assert_close(outs[i].cpu(), shards, ops[i][1], ops[i][3], dtype, emu.bf16_native(),
                          f"rank {rank} {what} call {i}")
        shards = [inputs.shard(seed + 100 * replay + 9, r, rs_m, rs_k, dtype) for r in range(world)]
        rows = slice(rank * rs_m // world, (rank + 1) * rs_m // world)
        magnitude = sum(a.double().abs() @ rs_b.double().abs() for a in shards)[rows]
        _bound_check(outs[2].cpu(), inputs.reference(shards, rs_b)[rows], (world + 2) * u * magnitude + 1e-6,
                     f"rank {rank} {what} gemm_reduce_scatter")

    def new_inputs(replay):
        for i, (m, k, _, _, _) in enumerate(shapes):
            ops[i][0].copy_(inputs.shard(seed + 100 * replay + i, rank, m, k, dtype))
        rs_a.copy_(inputs.shard(seed + 100 * replay + 9, rank, rs_m, rs_k, dtype))

    # The kernels' wait bound is in the captured KernelArgs: short, for the failing replay below.
    restore = _set_env(TORCH_GEMM_AR_TIMEOUT_S="3")
    try:
        new_inputs(0)
        check(queue_calls(), 0, "warm-up")  # the group's first call agrees over the process group: not capturable
        stream = emu.new_stream()
        emu.set_stream(stream)
        assert not emu.capturing()
        emu.begin_capture()
        assert emu.capturing() and torch_gemm_ar.check_errors is not None
        outs = queue_calls()
        graph = emu.end_capture()
        assert not emu.capturing()
        emu.replays_skip_counter(skip_counter)
        assert graph.launches() == 6, f"rank {rank}: the graph holds {graph.launches()} launches, not 6"
        for replay in range(1, replays + 1):
            new_inputs(replay)
            graph.replay()
            check(outs, replay, f"replay {replay}")
        torch_gemm_ar.check_errors()
        _model_clean(emu, f"rank {rank} replays", counted)

        failing = replays + 1
        new_inputs(failing)
        if rank == 1:
            emu.drop_next_launches(2)  # the first call's compute and comm kernels of this replay
        graph.replay()
        failed = outs[0].cpu()
        try:
            torch_gemm_ar.check_errors()
            raised = ""
        except RuntimeError as error:
            raised = str(error).splitlines()[0]
        emu.drop_next_launches(0)
        # The failed call's timeout delays the calls after it in that replay, by a different time on each rank: the
        # ranks meet (on CPU, outside the stream) once their devices finished it, so that the next replay does not
        # start within one timeout of a peer still busy with the failed one.
        torch.distributed.all_reduce(torch.zeros(1), group=group)
        new_inputs(failing + 1)
        graph.replay()
        check(outs, failing + 1, "replay after the failed one")
        torch_gemm_ar.check_errors()
        emu.set_stream(0)
    finally:
        emu.replays_skip_counter(False)
        restore()
    return bool(torch.isnan(failed).all()), raised


def test_captured_sequence_replayed_with_fresh_epochs(emulated_npu):
    library, pools = emulated_npu
    results = pools(2).run(_captured_replays, library, SEED + 53, 100)
    nan_everywhere, raised = results[0]
    assert nan_everywhere, "rank 0: the output of the call whose peer kernels were dropped in a replay is not all NaN"
    assert "rank 1" in raised, f"rank 0: check_errors() after the failed replay did not name rank 1: {raised!r}"


def test_negative_control_replays_reuse_the_capture_epoch(emulated_npu):
    """With the replayed counter increments doing nothing, every call of every replay runs with one epoch: the replay
    test must fail."""
    from rank_pool import RankFailure, RankPool

    library, _ = emulated_npu
    pool = RankPool(2)
    try:
        pool.run(_captured_replays, library, SEED + 53, 3, True, timeout_s=180)
        failure = ""
    except RankFailure as error:
        failure = str(error)
    finally:
        pool.close(force=True)
    assert failure, "replays that reused the capture's epoch went unnoticed by the replay test"
    assert _failed_only_as(failure, "replay"), f"failed for another reason: {failure}"


# One rank process of test_failure_reported_at_interpreter_exit: a fused call, then (with `fail`) one whose kernels
# rank 1 drops, and the process ends without another call or check_errors().
_EXIT_RANK = """
import os, sys
import torch
import torch.distributed as dist
import inputs, npu_emulated_ranks
rank, world, library, store, fail = int(sys.argv[1]), 2, sys.argv[2], sys.argv[3], sys.argv[4] == "1"
os.environ["TORCH_GEMM_AR_TIMEOUT_S"] = "3"
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
import torch_gemm_ar
emu = npu_emulated_ranks.load(library)
group = npu_emulated_ranks.group(library, "mesh")
a = inputs.shard(7, rank, 33, 40, torch.float16).to("npu")
b = inputs.weight(7, 40, 24, torch.float16, False).to("npu")
torch_gemm_ar.gemm_allreduce(a, b, group, algorithm="fused").cpu()
if fail and rank == 1:
    emu.drop_next_launches(2)
out = torch_gemm_ar.gemm_allreduce(a, b, group, algorithm="fused")
print("queued", flush=True)
"""


@pytest.mark.parametrize("fail", [False, True])
def test_failure_reported_at_interpreter_exit(emulated_npu, tmp_path, fail):
    """A rank process that ends after a failed call it never asked about reports the failure at exit (the host's
    exit-time check, torch_gemm_ar/errors.py): the message on stderr naming the peer, exit status 1. Without the
    failure, the same processes exit with 0 and say nothing."""
    import os
    import subprocess
    import sys

    library, _ = emulated_npu
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "exit_rank.py"
    script.write_text(_EXIT_RANK)
    # The tests' helpers only: torch_gemm_ar is the one this run imports (the installed package in CI). No empty
    # entry: it would put the working directory, the source tree, on the path.
    paths = [tests_dir, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), library, str(tmp_path / "store"),
                               "1" if fail else "0"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for rank in range(2)]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=180)
        finally:
            proc.kill()
        results.append((proc.returncode, out, err))
    for rank, (code, out, err) in enumerate(results):
        assert "queued" in out, f"rank {rank} did not get to queue its calls (exit {code}):\n{err[-3000:]}"
    left = [f for proc in procs for f in glob.glob(f"/dev/shm/gemm_ar_emu_{proc.pid}_*")]
    assert not left, f"a window's shared memory was left in /dev/shm: {left}"
    code, _, err = results[0]
    if not fail:
        for rank, (code, _, err) in enumerate(results):
            assert code == 0 and "never reported" not in err, f"rank {rank} exit {code} without a failure:\n{err}"
        return
    assert code == 1, f"rank 0 exited with {code} after a failure it never asked about:\n{err[-3000:]}"
    reported = [line for line in err.splitlines() if "a failed call was never reported before exit" in line]
    assert reported and "rank 1" in reported[0], f"rank 0's exit did not report rank 1's failure:\n{err[-3000:]}"
