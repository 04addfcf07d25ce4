"""`auto`'s gathered-inputs candidate on the CPU engine (`fused/gathered-inputs`, csrc/host/cpu/gathered_inputs.h):
where the inputs are small against the output, every rank publishes its a and b and each owner multiplies its rows
by every rank's K at once. It is offered only there, every rank decides it alike, the decided flow is the one that
runs, its results are right against float64 (each rank with its own b, odd shapes, bias, several M in one bucket),
a stress run catches stale inputs, and the deliberate ordering bug (inputs published after their flags) is caught."""
import os
import random

import pytest
import torch

import torch_gemm_ar
from hooked_build import hooked
from scoped_env import scoped_env
from test_auto_tuner import fresh_tuner
from inputs import TOLERANCE
from torch_gemm_ar import _C, tuning
from engine_observation_build import observe

ONE_CORE = dict(TORCH_GEMM_AR_COMPUTE_THREADS="1", TORCH_GEMM_AR_COMM_THREADS="0")
SLOW_US = 150_000  # added to every tuning run of the candidates that must lose
GATHERED = "fused/gathered-inputs"
# Not multiples of any tile; inputs K (M + N) = 68,000 against an output of 700,000 (under an eighth at the bucket's
# M, 1024, too).
M, K, N = 1000, 40, 700


def native(dtype):
    return dtype == torch.float32 or observe.reorders_b_per_product(torch.empty(0, dtype=dtype))


def per_rank_inputs(seed, world, m, k, n, dtype, bias):
    """Every rank's own a, b (nn.Linear's weight.t() on odd seeds) and bias (each rank's different: rank 0's is the
    one added, in every flow)."""
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(m, k, generator=g, dtype=torch.float64).to(dtype) for _ in range(world)]
    b = [torch.randn(n, k, generator=g, dtype=torch.float64).to(dtype).t() if seed % 2 else
         torch.randn(k, n, generator=g, dtype=torch.float64).to(dtype) for _ in range(world)]
    c = [torch.randn(n, generator=g, dtype=torch.float64).to(dtype) if bias else None for _ in range(world)]
    return a, b, c


def checked_call(rank, world, seed, m, k, n, dtype, bias):
    a, b, c = per_rank_inputs(seed, world, m, k, n, dtype, bias)
    out = torch_gemm_ar.gemm_allreduce(a[rank], b[rank], bias=c[rank], algorithm="auto")
    ref = sum(x.double() @ y.double() for x, y in zip(a, b)) + (c[0].double() if bias else 0)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ((k * world) ** 0.5 + 1))


def test_offered_only_where_the_inputs_are_small_against_the_output(one_core_env):
    f32 = torch.empty(0)
    with scoped_env(**ONE_CORE):
        offered = observe.suits_gathered_inputs(2048, 128, 4096, f32, 2)  # inputs 0.79M elements, output 8.4M
    assert offered
    # Not where the engine would not run it: comm threads (no owner-last walk) or a tile from the environment.
    with scoped_env(TORCH_GEMM_AR_COMPUTE_THREADS="1", TORCH_GEMM_AR_COMM_THREADS="1"):
        assert not observe.suits_gathered_inputs(2048, 128, 4096, f32, 2)
    with scoped_env(TORCH_GEMM_AR_CPU_TILE="256,512,64", **ONE_CORE):
        assert not observe.suits_gathered_inputs(2048, 128, 4096, f32, 2)


def test_offered_by_shape(one_core_env):
    f32 = torch.empty(0)
    assert observe.suits_gathered_inputs(M, K, N, f32, 3)
    assert not observe.suits_gathered_inputs(4096, 256, 2048, f32, 2)  # inputs 1.6M elements, output 8.4M: close
    assert not observe.suits_gathered_inputs(2048, 1024, 1024, f32, 2)  # inputs 3M elements, output 2M
    assert not observe.suits_gathered_inputs(100, 2, 200, f32, 2)  # an output under 64K elements
    assert not observe.suits_gathered_inputs(M, K, N, f32, 1)
    # bf16/fp16 only where the CPU multiplies them as they are (else the engine computes them in fp32).
    bf16 = torch.empty(0, dtype=torch.bfloat16)
    assert observe.suits_gathered_inputs(M, K, N, bf16, 2) == native(torch.bfloat16)


def tune_slowing(rank, world, seed, cache_path, dtype, bias, slow):
    """A fresh tuner decides the bucket of M with `slow` slowed ("!name": every candidate but that one)."""
    fresh_tuner(cache_path)
    _C._set_tuner_slow_candidate(slow, SLOW_US)  # the test build's (hooked_ranks)
    try:
        tuning.warm_up_until_tuned(lambda: checked_call(rank, world, seed, M, K, N, dtype, bias))
    finally:
        _C._set_tuner_slow_candidate("", 0)


def decided_and_run(rank, world, seed, cache_path, dtype, bias, slow):
    """Tunes the bucket of M with `slow` slowed ("!name": every candidate but that one), then runs decided calls of
    several M in the bucket; returns the decision and how many calls took the flow."""
    with scoped_env(**ONE_CORE):
        tune_slowing(rank, world, seed, cache_path, dtype, bias, slow)
        before = observe.gathered_inputs_calls()
        ms = [M, 513, 777, 1024, 640]
        for i, m in enumerate(ms):
            checked_call(rank, world, seed + 1 + i, m, K, N, dtype, bias)
        return tuning.decisions(), observe.gathered_inputs_calls() - before, len(ms)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_decided_everywhere_runs_and_is_right(hooked_ranks, tmp_path, world, dtype, bias):
    results = hooked_ranks(world).run(decided_and_run, random.randrange(1 << 20), str(tmp_path / "tune.json"), dtype,
                                      bias, "!" + GATHERED)
    decisions = [d for d, _, _ in results]
    assert all(len(d) == 1 for d in decisions), decisions
    chosen = {d[0]["algorithm"] for d in decisions}
    if not native(dtype):  # not offered: computed in fp32 on this CPU, so every candidate is slowed alike
        assert GATHERED not in decisions[0][0]["candidate_us"], decisions
        pytest.skip(f"{dtype} is computed in fp32 on this CPU (no AVX-512 BF16 or AMX): the flow is not offered "
                    "(checked above), so it cannot run")
    assert chosen == {GATHERED}, decisions  # alike on every rank
    for _, ran, calls in results:
        assert ran == calls  # the decided flow is the one that ran, at every M of the bucket


def test_negative_control_a_slow_flow_is_not_decided(hooked_ranks, tmp_path):
    results = hooked_ranks(2).run(decided_and_run, random.randrange(1 << 20), str(tmp_path / "tune.json"),
                                  torch.float32, False, GATHERED)
    for decisions, ran, _ in results:
        assert GATHERED in decisions[0]["candidate_us"] and decisions[0]["algorithm"] != GATHERED, decisions
        assert ran == 0


def stress(rank, world, seed, cache_path, calls, late):
    """Many decided calls with fresh inputs each, rank 1 a little late at random (so that a fast peer finds what the
    window holds before this rank's new inputs are in). Returns the calls whose result was wrong."""
    import time

    with scoped_env(**ONE_CORE):
        tune_slowing(rank, world, seed, cache_path, torch.float32, False, "!" + GATHERED)
        assert tuning.decision_for(M, K, N, torch.float32) == GATHERED
        rng = random.Random(seed + rank)
        wrong = 0
        with hooked("gathered_inputs_late", late):
            for i in range(calls):
                if rank == 1 and rng.random() < 0.5:
                    time.sleep(rng.random() * 2e-3)
                try:
                    checked_call(rank, world, seed + 10 + i, M, K, N, torch.float32, False)
                except AssertionError:
                    wrong += 1
                flags = torch.tensor([wrong])  # every rank stops at the first wrong call anywhere
                torch.distributed.all_reduce(flags)
                if flags.item():
                    break
        return wrong


def test_stress_fresh_inputs_every_call(hooked_ranks, tmp_path):
    assert hooked_ranks(2).run(stress, random.randrange(1 << 20), str(tmp_path / "tune.json"), 300, False,
                        timeout_s=300) == [0, 0]


def test_negative_control_inputs_published_after_their_flags_are_caught(hooked_ranks, tmp_path):
    """The stress test can fail: with this rank's inputs published after the flags that announce them, some call
    multiplies a peer's inputs of the call before."""
    wrong = hooked_ranks(2).run(stress, random.randrange(1 << 20), str(tmp_path / "tune.json"), 2000, True,
                                timeout_s=300)
    assert sum(wrong) > 0, wrong


def without_the_flow(rank, world, seed, cache_path):
    previous = _C._set_engine_option("tune_gathered_inputs", False)
    try:
        with scoped_env(**ONE_CORE):
            fresh_tuner(cache_path)
            tuning.warm_up_until_tuned(lambda: checked_call(rank, world, seed, M, K, N, torch.float32, False))
            return tuning.decisions()
    finally:
        _C._set_engine_option("tune_gathered_inputs", previous)


def test_the_switch_removes_the_candidate(ranks, tmp_path):
    for decisions in ranks(2).run(without_the_flow, random.randrange(1 << 20), str(tmp_path / "tune.json")):
        assert GATHERED not in decisions[0]["candidate_us"], decisions


def decided_then_cached(rank, world, seed, cache_path):
    with scoped_env(**ONE_CORE):
        tune_slowing(rank, world, seed, cache_path, torch.float32, True, "!" + GATHERED)
        observe.tuner_clear_memory()  # a new process, as far as the tuner knows: the decision comes from the file
        before = observe.gathered_inputs_calls()
        checked_call(rank, world, seed + 1, M, K, N, torch.float32, True)
        return [(d["algorithm"], d["source"]) for d in tuning.decisions()], observe.gathered_inputs_calls() - before


def test_the_decision_comes_back_from_the_tune_cache(hooked_ranks, tmp_path):
    cache = str(tmp_path / "tune.json")
    for decisions, ran in hooked_ranks(2).run(decided_then_cached, random.randrange(1 << 20), cache):
        assert decisions == [(GATHERED, "cache")] and ran == 1, decisions
    with open(cache) as f:
        assert f'"{GATHERED}"' in f.read()


def switch_differs(rank, world):
    previous = _C._set_engine_option("tune_gathered_inputs", rank != 0)
    try:
        with scoped_env(**ONE_CORE):
            fresh_tuner(os.path.join("/tmp", f"unused-{os.getpid()}.json"))
            checked_call(rank, world, 3, M, K, N, torch.float32, False)
            return None
    except ValueError as e:
        return str(e)
    finally:
        _C._set_engine_option("tune_gathered_inputs", previous)
        observe.tuner_clear_memory()


def test_ranks_that_differ_in_the_switch_get_an_error_not_a_hang(ranks):
    for message in ranks(2).run(switch_differs, timeout_s=120):
        assert message is not None and "engine's options" in message, message


def tile_env_differs(rank, world):
    """Rank 1 has TORCH_GEMM_AR_CPU_TILE set to the tile the rules pick for this call anyway (so the tiles in the
    signature match): with a tile from the environment no family is forced and the gathered-inputs flow is off, so
    the ranks would run different flows unless the setting itself is agreed."""
    assert os.environ.get("TORCH_GEMM_AR_CPU_TILE") is None
    env = dict(ONE_CORE, TORCH_GEMM_AR_CPU_TILE="256,512,64") if rank == 1 else ONE_CORE
    with scoped_env(**env):
        fresh_tuner(os.path.join("/tmp", f"unused-{os.getpid()}.json"))
        try:
            checked_call(rank, world, 5, 300, 19, 500, torch.float32, False)
            return None
        except ValueError as e:
            return str(e)
        finally:
            observe.tuner_clear_memory()


def test_ranks_that_differ_in_the_tile_from_the_environment_get_an_error(ranks):
    for message in ranks(2).run(tile_env_differs, timeout_s=120):
        assert message is not None and "engine's options" in message, message
