"""The one-shot reduction of small gemm_allreduce calls on one-core ranks (csrc/host/cpu/one_shot_compute.cpp):
against float64 and bit for bit against the reduce-scatter + all-gather way, on shapes that are not multiples of the
tiles, world sizes 2-4 and three dtypes; that the path is really taken; back-to-back stress with fresh inputs, shapes
on both sides of the size limit and a rank that runs late; and a negative control (partials in one bank whatever the call's
parity) that the stress test must catch."""
import random
import time

import pytest
import torch

import torch_gemm_ar
from torch_gemm_ar import _C
from expect import error_of_a_fused_call_with
from inputs import assert_matches, bias_vector, digest, reference, shard, weight
from hooked_build import hooked
from scoped_env import engine_switch, scoped_env
from stress_call import fused_call_is_right
from engine_observation_build import observe

# Comm between tiles on the caller's thread (one core per rank), the engine's default tiles (256 x 512): the
# one-shot reduction's home. Its choice depends only on the call, so every rank makes the same: (world - 1) x M x N
# x 4 bytes at most 4 MiB (kOneShotMaxReadBytes).
INLINE = dict(TORCH_GEMM_AR_COMM_THREADS="0", TORCH_GEMM_AR_COMPUTE_THREADS="1")

# (M, K, N), not multiples of anything. One shot at world 2-4 (M x N x 4 bytes at most 1.3 MiB; one to ten tiles)
# where partials are 4 bytes, then two phases at every world (over 4 MiB).
ONE_SHOT = [(1, 1, 1), (1, 300, 257), (7, 33, 700), (129, 70, 511), (256, 5, 512), (200, 3, 1000), (3, 20, 5000)]
TWO_PHASE = [(300, 9, 4000), (1100, 40, 1000)]


def four_byte_partials(dtype) -> bool:
    """One shot is for 4-byte partials: bf16/fp16 computed natively (2-byte partials) always take two phases."""
    return dtype == torch.float32 or _C._computes_in_fp32(torch.empty(0, dtype=dtype))


def fused(a, b, bias, one_shot: bool):
    previous = _C._set_engine_option("one_shot", one_shot)
    try:
        before = observe.one_shot_calls()
        out = torch_gemm_ar.gemm_allreduce(a, b, bias=bias, algorithm="fused")
        return out, observe.one_shot_calls() - before
    finally:
        _C._set_engine_option("one_shot", previous)


def one_shot_against_two_phase(rank, world, seed):
    results = []
    # Decode calls (M <= 64) take their own geometry and dtype (tests/test_decode.py): here the one-shot reduction on
    # the same tiles as the two-phase way.
    with scoped_env(**INLINE), engine_switch("decode", False):
        for i, (m, k, n) in enumerate(ONE_SHOT + TWO_PHASE):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                step = seed + 31 * i
                shards = [shard(step, r, m, k, dtype) for r in range(world)]
                b = weight(step, k, n, dtype, transposed=i % 2 == 1)
                bias = bias_vector(step, n, dtype) if i % 3 == 0 else None
                if (i + len(results)) % 2:  # either order: one-shot calls on both bank parities, now and then in a row
                    one, taken = fused(shards[rank], b, bias, one_shot=True)
                    two, not_taken = fused(shards[rank], b, bias, one_shot=False)
                else:
                    two, not_taken = fused(shards[rank], b, bias, one_shot=False)
                    one, taken = fused(shards[rank], b, bias, one_shot=True)
                what = f"M={m} K={k} N={n} {dtype} world {world}"
                assert_matches(one, reference(shards, b, bias), dtype, k, world, what)
                assert torch.equal(one, two), f"{what}: one-shot and two-phase results differ"
                assert not_taken == 0, what
                results.append((m, k, n, str(dtype), four_byte_partials(dtype), taken, digest(one)))
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_one_shot_matches_float64_and_the_two_phase_way(ranks, world):
    per_rank = ranks(world).run(one_shot_against_two_phase, random.randrange(1 << 20), timeout_s=300)
    assert all(r == per_rank[0] for r in per_rank), "ranks returned different bits"  # digests included
    for m, k, n, dtype, four_bytes, taken, _ in per_rank[0]:
        assert taken == ((m, k, n) in ONE_SHOT and four_bytes), f"M={m} K={k} N={n} {dtype}: one-shot calls {taken}"


def add_rmsnorm_both_ways(rank, world, seed):
    """gemm_allreduce_add_rmsnorm and its in-place form, one shot and two phases: the same bits, and the float64
    reference (a residual add, then RMSNorm)."""
    counts = []
    with scoped_env(**INLINE), engine_switch("decode", False):  # as in one_shot_against_two_phase
        for i, (m, k, n) in enumerate(ONE_SHOT + TWO_PHASE):
            for dtype in (torch.float32, torch.bfloat16):
                step = seed + 17 * i
                shards = [shard(step, r, m, k, dtype) for r in range(world)]
                b = weight(step, k, n, dtype, transposed=False)
                residual = shard(step, world + 1, m, n, dtype)  # the same on every rank
                norm_weight = bias_vector(step, n, dtype)
                what = f"M={m} K={k} N={n} {dtype} world {world}"
                outs = {}
                for one_shot in (True, False):
                    previous = _C._set_engine_option("one_shot", one_shot)
                    try:
                        before = observe.one_shot_calls()
                        out, normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm(shards[rank], b, residual, norm_weight,
                                                                               algorithm="fused")
                        in_place = residual.clone()
                        with torch.no_grad():
                            normed_ = torch_gemm_ar.gemm_allreduce_add_rmsnorm_(shards[rank], b, in_place, norm_weight,
                                                                                algorithm="fused")
                        outs[one_shot] = (out, normed, in_place, normed_)
                        counts.append((m, k, n, one_shot and four_byte_partials(dtype), observe.one_shot_calls() - before))
                    finally:
                        _C._set_engine_option("one_shot", previous)
                for x, y in zip(outs[True], outs[False]):
                    assert torch.equal(x, y), f"{what}: one-shot and two-phase results differ"
                want = reference(shards, b) + residual.double()
                assert_matches(outs[True][0], want, dtype, k, world, what)
                assert torch.equal(outs[True][2], outs[True][0]), f"{what}: in-place residual differs"
                # The norm of the sum the op returned (checked above): in bf16 that sum is rounded, so the float64 sum's
                # norm differs from it by up to a few bf16 steps (0.049 at 2 of 2.4M elements at N=8000).
                got = outs[True][0].double()
                want_normed = got * torch.rsqrt(got.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight.double()
                tol = 3e-5 if dtype == torch.float32 else 1e-2
                torch.testing.assert_close(outs[True][1].double(), want_normed, rtol=tol, atol=tol,
                                           msg=lambda msg: f"{what} normed: {msg}")
    return counts


@pytest.mark.parametrize("world", [2, 3])
def test_one_shot_add_rmsnorm_matches_the_two_phase_way(ranks, world):
    for counts in ranks(world).run(add_rmsnorm_both_ways, random.randrange(1 << 20), timeout_s=300):
        for m, k, n, one_shot, taken in counts:
            assert taken == (2 if one_shot and (m, k, n) in ONE_SHOT else 0), (m, k, n, one_shot, taken)


def random_call(seed, step):
    rng = random.Random(seed * 1_000_003 + step)
    if rng.random() < 0.15:  # too large for one shot: the two-phase way, sharing the windows with one-shot calls
        m, k, n = rng.randint(300, 400), rng.randint(1, 16), rng.randint(3600, 4000)
    elif rng.random() < 0.4:  # a whole tile with a short K: the partials are written quickly, read slowly
        m, k, n = rng.randint(200, 256), rng.randint(1, 8), rng.randint(400, 512)
    else:  # one or two tiles
        m, k, n = rng.randint(1, 256), rng.randint(1, 64), rng.randint(1, 1000)
    return m, k, n, rng.choice([torch.float32, torch.float32, torch.bfloat16]), rng.random() < 0.3


def stress(rank, world, seed, calls, single_bank=False):
    """Back-to-back fused calls with new inputs and shapes; a rank runs late now and then. Returns the number of wrong
    results, of one-shot calls, and of calls with 4-byte partials (those that may take one shot)."""
    wrong = eligible = 0
    before = observe.one_shot_calls()
    with hooked("one_shot_single_bank", single_bank), scoped_env(**INLINE):
        for step in range(calls):
            m, k, n, dtype, with_bias = random_call(seed, step)
            eligible += four_byte_partials(dtype)
            if rank == step % world and step % 7 == 0:
                time.sleep(0.001)
            wrong += not fused_call_is_right(rank, world, seed + step, m, k, n, dtype, with_bias)
    return wrong, observe.one_shot_calls() - before, eligible


@pytest.mark.parametrize("world,calls", [(2, 1500), (3, 500), (4, 300)])
def test_one_shot_back_to_back_stress(ranks, world, calls):
    results = ranks(world).run(stress, random.randrange(1 << 30), calls, timeout_s=600)
    assert [wrong for wrong, _, _ in results] == [0] * world, f"wrong results per rank: {results}"
    # About 85% of the calls with 4-byte partials are small enough (bf16 computed natively never takes one shot).
    assert all(one_shot > eligible // 2 for _, one_shot, eligible in results), results


def test_negative_control_stress_catches_a_single_bank(hooked_ranks):
    """With the partials in one bank whatever the call's parity, a rank's next call overwrites partials a slower
    peer still reads: the same stress test must report wrong results."""
    # Rounds of 1500 calls until one notices, at most 6000 calls: where bf16 is computed natively only the fp32 calls
    # take one shot, and a single round sometimes misses the bug.
    pool, seen = hooked_ranks(2), []
    for _ in range(4):
        seen.append(pool.run(stress, random.randrange(1 << 30), 1500, True, timeout_s=600))
        if sum(wrong for wrong, _, _ in seen[-1]) > 0:
            break
    assert sum(wrong for wrong, _, _ in seen[-1]) > 0, f"the stress test did not notice a single bank: {seen}"
    # Fine again once the bug is switched off.
    assert [wrong for wrong, _, _ in pool.run(stress, random.randrange(1 << 30), 100)] == [0, 0]


def mixed_comm_threads(rank, world):
    # Rank 0 runs comm between tiles (one-shot for this small call), rank 1 on a comm thread (two phases).
    with scoped_env(TORCH_GEMM_AR_COMM_THREADS="0" if rank == 0 else "1", TORCH_GEMM_AR_COMPUTE_THREADS="1"):
        a, b = torch.randn(3, 8), torch.randn(8, 16)
        try:
            torch_gemm_ar.gemm_allreduce(a, b, algorithm="fused")
        except (ValueError, RuntimeError) as e:
            return type(e).__name__, str(e)
    return None, ""


def test_ranks_that_differ_in_comm_threads_get_an_error_not_a_hang(ranks):
    for kind, message in ranks(2).run(mixed_comm_threads, timeout_s=120):
        assert kind is not None, "ranks with different TORCH_GEMM_AR_COMM_THREADS ran a call together"
        assert "TORCH_GEMM_AR_COMM_THREADS" in message, message


def after_failed_calls(rank, world, seed, calls, skip_previous_call_wait=False):
    """One-shot calls of the largest size, each followed by a call that every rank rejects on its own arguments (it
    raises at once, without waiting for the peers) and by another one-shot call, with other ops in between now and
    then; a rank runs late now and then. Returns the number of wrong results."""
    rng = random.Random(seed)
    n = 4096 if world == 2 else 2048  # (world - 1) x 256 x n x 4 bytes: at the one-shot limit
    wrong = 0
    with hooked("skip_previous_call_wait", skip_previous_call_wait):
        with scoped_env(**INLINE):
            for step in range(calls):
                m, k = rng.randint(200, 256), rng.randint(1, 4)
                shards = [shard(seed + step, r, m, k, torch.float32) for r in range(world)]
                b = weight(seed + step, k, n, torch.float32, transposed=False)
                if rank == step % world and step % 3 == 0:
                    time.sleep(0.002)
                out = torch_gemm_ar.gemm_allreduce(shards[rank], b, algorithm="fused")
                with pytest.raises(ValueError, match="K="):
                    torch_gemm_ar.gemm_allreduce(shards[rank], b[:-1] if k > 1 else torch.ones(2, n), algorithm="fused")
                if step % 5 == 4:  # another op between: it shares the windows and the call numbers
                    rows = 2 * world
                    scattered = torch_gemm_ar.gemm_reduce_scatter(shard(seed, rank, rows, 3, torch.float32),
                                                                  torch.ones(3, 5), algorithm="fused")
                    want = reference([shard(seed, r, rows, 3, torch.float32) for r in range(world)], torch.ones(3, 5))
                    wrong += not torch.allclose(scattered.double(), want[rank * 2:rank * 2 + 2], atol=1e-4)
                again = torch_gemm_ar.gemm_allreduce(shards[rank], b, algorithm="fused")
                want = reference(shards, b)
                for got in (out, again):
                    wrong += not torch.allclose(got.double(), want, rtol=3e-5, atol=1e-4)
    return wrong


@pytest.mark.parametrize("world,calls", [(2, 300), (3, 150)])
def test_one_shot_after_calls_that_failed_on_their_own(ranks, world, calls):
    wrong = ranks(world).run(after_failed_calls, random.randrange(1 << 30), calls, timeout_s=600)
    assert wrong == [0] * world, f"wrong results per rank: {wrong}"


def test_negative_control_stress_catches_a_bank_written_too_early(hooked_ranks):
    """Without the check that every peer has started the previous call, a rank whose previous call raised at once
    writes into its window while a slower peer still reads its one-shot data: the test above must then fail (wrong
    results, or a peer that misses its flags and times out)."""
    from rank_pool import RankFailure

    pool = hooked_ranks(3)
    try:
        wrong = pool.run(after_failed_calls, random.randrange(1 << 30), 150, True, timeout_s=600)
    except RankFailure as failure:  # a rank waited for a flag its peer had already overwritten
        assert "did not deliver" in str(failure), failure
        return
    finally:
        pool.close(force=True)  # its engines may have stopped after the failure: later tests get fresh ranks
    assert sum(wrong) > 0, "the stress test did not notice calls that skip the check"


def mixed_switches(rank, world):
    return error_of_a_fused_call_with("one_shot", rank == 0, INLINE, (3, 8), (8, 16))


def test_ranks_that_differ_in_an_engine_option_get_an_error_not_a_hang(ranks):
    for message in ranks(2).run(mixed_switches, timeout_s=120):
        assert "engine's options" in message, message
