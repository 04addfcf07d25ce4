"""`algorithm="auto"` by measurement (torch_gemm_ar.tuning): every tuning call is correct, every rank takes the same
decision, decisions are logged and cached per host, a cache is trusted only when every rank has the same entry,
tune() decides ahead of time, ranks whose tuning states drift apart get a clear error and start again together."""
import json
import logging
import os
import re
import random
import time

import pytest
import torch

import torch_gemm_ar
from expect import raises
from hooked_build import hooked
from scoped_env import scoped_env
from inputs import TOLERANCE, reference, shard, weight
from torch_gemm_ar import _C, tuning
from engine_observation_build import observe


def fresh_tuner(cache_path, budget_ms=0):
    """A tuner with no memory. budget_ms=0: every bucket takes exactly TORCH_GEMM_AR_AUTOTUNE_REPS rounds (these
    tests count calls); the adaptive rounds have their own test."""
    os.environ["TORCH_GEMM_AR_TUNE_CACHE"] = cache_path
    os.environ["TORCH_GEMM_AR_AUTOTUNE_BUDGET_MS"] = str(budget_ms)
    os.environ.pop("TORCH_GEMM_AR_AUTOTUNE", None)
    observe.tuner_clear_memory()


def tuning_calls(reps, candidates=3):
    """Calls a race of `candidates` with `reps` runs each takes, the deciding call included: one warm-up
    round first, then `reps` timed rounds."""
    return candidates * (reps + 1) + 1


def checked_auto_call(rank, world, seed, m, k, n, dtype=torch.float32):
    shards = [shard(seed, r, m, k, dtype) for r in range(world)]
    b = weight(seed, k, n, dtype, transposed=True)
    out = torch_gemm_ar.gemm_allreduce(shards[rank], b, algorithm="auto")
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), reference(shards, b), rtol=tol, atol=tol * ((k * world) ** 0.5 + 1))
    return out


class Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def tune_by_calls(rank, world, seed, cache_path, calls):
    fresh_tuner(cache_path)
    handler = Captured()
    tuning.logger.addHandler(handler)
    tuning.logger.setLevel(logging.INFO)
    try:
        for i in range(calls):  # random M inside one bucket (65..128): every call checked against float64
            checked_auto_call(rank, world, seed + i, random.Random(seed + i).randint(65, 128), 40, 90)
    finally:
        tuning.logger.removeHandler(handler)
    # What auto runs per shape: the bucket's decision (any M of 65..128), none for a K never met.
    looked_up = [tuning.decision_for(m, 40, 90) for m in (65, 100, 128)] + [tuning.decision_for(100, 41, 90)]
    return tuning.decisions(), handler.messages, looked_up


@pytest.mark.parametrize("world", [2, 3])
def test_first_calls_tune_then_every_rank_decides_alike(ranks, world, tmp_path):
    reps = int(os.environ.get("TORCH_GEMM_AR_AUTOTUNE_REPS", "3"))
    calls = tuning_calls(reps) + 3  # fused, sequential, chunked: warm-up + reps, the deciding call, 3 decided calls
    results = ranks(world).run(tune_by_calls, random.randrange(1 << 20), str(tmp_path / "tune.json"), calls)
    decisions = [d for d, _, _ in results]
    assert all(len(d) == 1 for d in decisions), decisions
    assert len({d[0]["algorithm"] for d in decisions}) == 1, decisions  # the same on every rank
    first = decisions[0][0]
    assert first["source"] == "measured"
    assert set(first["candidate_us"]) == {"fused", "sequential", "chunked"}, first
    relative = first["candidate_relative"]
    assert first["algorithm"] == min(relative, key=relative.get) and min(relative.values()) >= 1.0, first
    assert first["candidate_runs"] == {"fused": reps, "sequential": reps, "chunked": reps}, first
    assert "m<=128" in first["bucket"] and f"world={world}" in first["bucket"]
    for _, messages, looked_up in results:
        assert any(first["algorithm"] in m and "median of its runs" in m and f"in {reps} runs" in m
                   for m in messages), messages
        assert looked_up == [first["algorithm"]] * 3 + [None], looked_up
    with open(tmp_path / "tune.json") as f:
        cached = json.load(f)
    (entries,) = cached.values()
    assert entries[first["bucket"]] == first["algorithm"]


def use_cache(rank, world, seed, cache_path):
    fresh_tuner(cache_path)
    checked_auto_call(rank, world, seed, 100, 40, 90)
    return tuning.decisions()


def test_a_cached_decision_is_used_when_every_rank_has_it(ranks, tmp_path):
    path = str(tmp_path / "tune.json")
    ranks(2).run(tune_by_calls, 11, path, tuning_calls(3))
    with open(path) as f:
        (entries,) = json.load(f).values()
    results = ranks(2).run(use_cache, 12, path)
    for decisions in results:
        assert len(decisions) == 1 and decisions[0]["source"] == "cache", decisions
        assert decisions[0]["algorithm"] == entries[decisions[0]["bucket"]]


def rank_own_cache(rank, world, seed, directory, reps):
    """Each rank has its own cache file that says a different algorithm for the bucket (as ranks on different
    hosts may): no rank may trust its own, so they tune together."""
    path = os.path.join(directory, f"rank{rank}.json")
    fresh_tuner(path)
    checked_auto_call(rank, world, seed, 100, 40, 90)  # learn the bucket's key from the decision after tuning
    for i in range(tuning_calls(reps) - 1):
        checked_auto_call(rank, world, seed + i, 100, 40, 90)
    (decision,) = tuning.decisions()
    with open(path) as f:
        data = json.load(f)
    (fingerprint,) = data
    # Per build: the sources' hash is in the fingerprint, so a rebuilt engine tunes anew.
    assert re.search(r"torch_gemm_ar [^ ]+ \(sources [0-9a-f]{12}\)", fingerprint), fingerprint
    data[fingerprint][decision["bucket"]] = ["fused", "sequential"][rank % 2]
    with open(path, "w") as f:
        json.dump(data, f)
    observe.tuner_clear_memory()
    for i in range(tuning_calls(reps)):
        checked_auto_call(rank, world, seed + 100 + i, 100, 40, 90)
    return tuning.decisions()


def test_caches_that_differ_between_ranks_are_not_trusted(ranks, tmp_path):
    os.environ.pop("TORCH_GEMM_AR_AUTOTUNE_REPS", None)
    results = ranks(2).run(rank_own_cache, 21, str(tmp_path), 3)
    for decisions in results:
        assert [d["source"] for d in decisions] == ["measured"], decisions
    assert results[0][0]["algorithm"] == results[1][0]["algorithm"]


def cache_kept_across_builds(rank, world, seed, directory, reps):
    """Tunes one bucket, then (as other processes would) adds to the file: an entry in this build's section, four
    sections of other builds of this host (three written at known times, one never stamped), a section of another
    host; written on one line (a reformatted file must still be read). Tuning a second bucket must keep the other
    process's entry, the other host, and of this host's other builds the three written last."""
    path = os.path.join(directory, f"rank{rank}.json")  # per rank: the edits below are not a race between ranks
    fresh_tuner(path)
    for i in range(tuning_calls(reps)):
        checked_auto_call(rank, world, seed + i, 100, 40, 90)
    with open(path) as f:
        data = json.load(f)
    (fingerprint,) = data
    assert int(data[fingerprint]["written at"]) > 1_700_000_000, data[fingerprint]
    host, build = fingerprint.split(" | torch_gemm_ar ")
    older = {f"{host} | torch_gemm_ar 0.0.{i} (sources 00000000000{i}) | torch 1.0.0": {"written at": str(stamp)}
             for i, stamp in enumerate([300, 100, 200, None])}
    for name, section in older.items():
        section["m<=128 k=40 n=90 of an older build"] = "fused"
        if section["written at"] == "None":
            del section["written at"]
    elsewhere = f"Another CPU | 96 cores | torch_gemm_ar {build}"
    data[fingerprint]["m<=1 k=1 n=1 from another process"] = "sequential"
    data.update(older)
    data[elsewhere] = {"m<=128 k=40 n=90 elsewhere": "chunked"}
    with open(path, "w") as f:
        json.dump(data, f)
    for i in range(tuning_calls(reps)):  # a second bucket (another K): its decision is written into the file
        checked_auto_call(rank, world, seed + 50 + i, 100, 56, 90)
    with open(path) as f:
        return fingerprint, list(older), elsewhere, json.load(f), [d["bucket"] for d in tuning.decisions()]


def test_the_cache_keeps_other_processes_hosts_and_the_last_builds(ranks, tmp_path):
    os.environ.pop("TORCH_GEMM_AR_AUTOTUNE_REPS", None)
    for fingerprint, older, elsewhere, data, buckets in ranks(2).run(cache_kept_across_builds, 31, str(tmp_path), 3):
        assert len(buckets) == 2, buckets
        # Four builds per host: this one and the three written last (300, 200, 100); the unstamped one is gone.
        assert set(data) == {fingerprint, elsewhere, *older[:3]}, list(data)
        assert set(data[fingerprint]) == set(buckets) | {"m<=1 k=1 n=1 from another process", "written at"}
        assert data[elsewhere] == {"m<=128 k=40 n=90 elsewhere": "chunked"}
    assert not [name for name in os.listdir(tmp_path) if ".tmp." in name]


def decide_while_the_cache_is_locked(rank, world, seed, directory, reps):
    """Another process holds the cache's lock (stopped in a debugger, say): the decision is still taken and written,
    after the bounded wait for the lock."""
    import fcntl

    path = os.path.join(directory, f"rank{rank}.json")
    fresh_tuner(path)
    longest = 0.0
    with open(path + ".lock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        for i in range(tuning_calls(reps)):
            start = time.monotonic()
            checked_auto_call(rank, world, seed + i, 100, 40, 90)
            longest = max(longest, time.monotonic() - start)
    (decision,) = tuning.decisions()
    with open(path) as f:
        (entries,) = json.load(f).values()
    return decision, entries, longest


def test_a_held_cache_lock_delays_the_write_but_does_not_stop_it(ranks, tmp_path):
    os.environ.pop("TORCH_GEMM_AR_AUTOTUNE_REPS", None)
    for decision, entries, longest in ranks(2).run(decide_while_the_cache_is_locked, 51, str(tmp_path), 3,
                                                   timeout_s=120):
        assert entries[decision["bucket"]] == decision["algorithm"], entries
        assert longest >= 1.9, f"the deciding call did not wait for the held lock ({longest:.2f} s)"


def single_candidate(rank, world, seed, cache_path):
    """The engine off (as on ranks of several hosts) and M=1 (no row per chunk): sequential is auto's only candidate.
    Its bucket is decided at the first call, with nothing measured, logged or cached."""
    import torch.distributed as dist

    fresh_tuner(cache_path)
    with scoped_env(TORCH_GEMM_AR_CPU_ENGINE="0"):  # read when the group's engine is set up, at its first call
        group = dist.new_group(list(range(world)))
        torch_gemm_ar.gemm_allreduce(torch.ones(1, 1), torch.ones(1, 1), group, algorithm="sequential")
    try:
        b = weight(seed, 40, 90, torch.float32, transposed=False)
        shards = [shard(seed, r, 1, 40, torch.float32) for r in range(world)]
        for _ in range(3):
            out = torch_gemm_ar.gemm_allreduce(shards[rank], b, group, algorithm="auto")
            torch.testing.assert_close(out.double(), reference(shards, b), rtol=1e-4, atol=1e-4 * (40 * world) ** 0.5)
        return (tuning.decision_for(1, 40, 90, group=group), tuning.in_progress(group), tuning.decisions(),
                os.path.exists(cache_path))
    finally:
        dist.destroy_process_group(group)


def test_a_bucket_with_one_candidate_is_decided_at_once(ranks, tmp_path):
    for decision, in_progress, decisions, cached in ranks(2).run(single_candidate, 41, str(tmp_path / "t.json")):
        assert decision == "sequential" and not in_progress, (decision, in_progress)
        assert decisions == [] and not cached, decisions


def tune_ahead(rank, world, cache_path):
    fresh_tuner(cache_path)
    taken = torch_gemm_ar.tune([(1, 64, 96), (300, 64, 96)], dtype=torch.float32)
    count = len(tuning.decisions())
    for seed in range(5):  # decided buckets: no more tuning, results still exact
        checked_auto_call(rank, world, seed, 1, 64, 96)
        checked_auto_call(rank, world, seed, 300, 64, 96)
    return taken, count, len(tuning.decisions())


def test_tune_decides_ahead_of_serving(ranks, tmp_path):
    results = ranks(2).run(tune_ahead, str(tmp_path / "tune.json"))
    for taken, count, after in results:
        assert [d["source"] for d in taken] == ["measured", "measured"], taken
        assert after == count == 2
    assert [d["algorithm"] for d in results[0][0]] == [d["algorithm"] for d in results[1][0]]


def tune_decode(rank, world, cache_path):
    fresh_tuner(cache_path)
    taken = torch_gemm_ar.tune([(300, 64, 96)], dtype=torch.float32, decode=True)
    checked_auto_call(rank, world, 7, 3, 64, 96)  # a decided decode bucket: exact, no more tuning
    return ([d["bucket"] for d in taken], [tuning.decision_for(m, 64, 96) for m in tuning.DECODE_ROWS],
            tuning.in_progress())


def test_tune_covers_the_decode_buckets(ranks, tmp_path):
    results = ranks(2).run(tune_decode, str(tmp_path / "tune.json"))
    for buckets, decided, in_progress in results:
        assert len(buckets) == 1 + len(tuning.DECODE_ROWS), buckets
        assert [f"m<={m};" in b for m, b in zip(tuning.DECODE_ROWS, buckets[1:])] == [True] * len(tuning.DECODE_ROWS)
        assert None not in decided and not in_progress, (decided, in_progress)
    assert results[0][1] == results[1][1]


def static_when_disabled(rank, world, cache_path):
    fresh_tuner(cache_path)
    os.environ["TORCH_GEMM_AR_AUTOTUNE"] = "0"
    try:
        for seed in range(4):
            checked_auto_call(rank, world, seed, 100, 40, 90)
        raises(lambda: torch_gemm_ar.tune([(4, 4, 4)]), "TORCH_GEMM_AR_AUTOTUNE=0", exc=RuntimeError)
        return tuning.decisions(), os.path.exists(cache_path)
    finally:
        os.environ.pop("TORCH_GEMM_AR_AUTOTUNE")


def test_autotune_0_keeps_the_static_policy(ranks, tmp_path):
    for decisions, written in ranks(2).run(static_when_disabled, str(tmp_path / "tune.json")):
        assert decisions == [] and not written


def drift_apart(rank, world, cache_path):
    """Rank 1 forgets its tuning state halfway (a negative control for the lockstep the tuner relies on): both
    ranks must raise the tuning-step disagreement, then tune again together and decide alike."""
    fresh_tuner(cache_path)
    for seed in range(3):
        checked_auto_call(rank, world, seed, 100, 40, 90)
    if rank == 1:
        observe.tuner_clear_memory()
    raises(lambda: checked_auto_call(rank, world, 3, 100, 40, 90), "auto` tuning step", exc=ValueError)
    for seed in range(4, 4 + tuning_calls(3)):
        checked_auto_call(rank, world, seed, 100, 40, 90)
    return tuning.decisions()


def test_ranks_whose_tuning_drifts_apart_raise_then_retune_together(ranks, tmp_path):
    os.environ.pop("TORCH_GEMM_AR_AUTOTUNE_REPS", None)
    results = ranks(2).run(drift_apart, str(tmp_path / "tune.json"))
    assert [len(d) for d in results] == [1, 1], results
    assert results[0][0]["algorithm"] == results[1][0]["algorithm"]


def tune_with_deferred_clock(rank, world, seed, cache_path, calls):
    with hooked("deferred_tuner_clock", 1):
        return tune_by_calls(rank, world, seed, cache_path, calls)[0]


def test_a_device_clock_read_at_the_next_call_tunes_alike(hooked_ranks, tmp_path):
    """The NPU's path (each tuning call's clock read at the bucket's next call), run on the host's clock."""
    reps = int(os.environ.get("TORCH_GEMM_AR_AUTOTUNE_REPS", "3"))
    decisions = hooked_ranks(2).run(tune_with_deferred_clock, random.randrange(1 << 20), str(tmp_path / "t.json"),
                             tuning_calls(reps) + 1)
    assert all(len(d) == 1 for d in decisions), decisions
    assert decisions[0][0]["algorithm"] == decisions[1][0]["algorithm"], decisions
    times = decisions[0][0]["candidate_us"]
    assert set(times) == {"fused", "sequential", "chunked"}, times
    # A clock that was never read would leave 0 us: every candidate must have been timed.
    assert all(t > 0 for t in times.values()), times


def unreadable_clock_on_rank_1(rank, world, seed, cache_path):
    fresh_tuner(cache_path)
    errors = []
    with hooked("deferred_tuner_clock", 2 if rank == 1 else 1):
        for i in range(4):
            try:
                checked_auto_call(rank, world, seed + i, 100, 40, 90)
            except RuntimeError as e:
                errors.append((i, type(e).__name__, str(e)))
    checked_auto_call(rank, world, seed + 9, 100, 40, 90)  # the group goes on afterwards
    return errors


def test_a_device_clock_that_cannot_be_read_raises_on_every_rank(hooked_ranks, tmp_path):
    results = hooked_ranks(2).run(unreadable_clock_on_rank_1, random.randrange(1 << 20), str(tmp_path / "t.json"))
    # The first tuning call's clock is read by the second call: that call raises on both ranks, not only rank 1.
    for rank, errors in enumerate(results):
        assert errors and errors[0][0] == 1, (rank, errors)
        assert all(name == "RuntimeError" for _, name, _ in errors), errors
    assert "timing the previous tuning call" in results[1][0][2], results[1]
    assert "did not finish in time" in results[0][0][2] and "rank 1" in results[0][0][2], results[0]


def tune_with_a_late_rank(rank, world, seed, cache_path, delay_us, from_last_start):
    """Rank 1 starts every tuning run `delay_us` late, as a rank woken late from the previous collective does; rank
    0 starts at once and waits inside the call (fused, and sequential's all_reduce) for rank 1."""
    with hooked("tuner_start_delay_us", delay_us if rank == 1 else 0), hooked("tuner_own_time", not from_last_start):
        reps = int(os.environ.get("TORCH_GEMM_AR_AUTOTUNE_REPS", "3"))
        return tune_by_calls(rank, world, seed, cache_path, tuning_calls(reps))[0]


@pytest.mark.parametrize("from_last_start", [True, False], ids=["from_last_start", "negative_control_slowest_rank"])
def test_a_late_rank_does_not_count_in_the_candidates_times(hooked_ranks, tmp_path, from_last_start):
    """Tuning counts a run from its last rank's start to its last rank's end (one host, one monotonic clock), so a
    late rank's delay is in no candidate's time. Negative control: the slowest rank's own time (the old measure)
    includes the wait for the late rank in every candidate."""
    delay_us = 300_000  # far above a call of this size (K=40, N=90, M<=128: well under a millisecond unloaded)
    results = hooked_ranks(2).run(tune_with_a_late_rank, random.randrange(1 << 20), str(tmp_path / "t.json"), delay_us,
                           from_last_start)
    (decision,) = results[0]
    assert decision["algorithm"] == results[1][0]["algorithm"]
    times = decision["candidate_us"]
    assert set(times) == {"fused", "sequential", "chunked"}, times
    if from_last_start:
        assert all(0 < t < delay_us / 2 for t in times.values()), times
    else:
        # The early rank's wait for the late one, less the moment it itself started after that rank: near delay_us.
        assert all(t > delay_us / 2 for t in times.values()), times


def race(rank, world, cache_path, budget_ms, min_reps, max_reps, slow, slow_us, m=100):
    fresh_tuner(cache_path, budget_ms)
    os.environ["TORCH_GEMM_AR_AUTOTUNE_REPS"] = str(min_reps)
    os.environ["TORCH_GEMM_AR_AUTOTUNE_MAX_REPS"] = str(max_reps)
    _C._set_tuner_slow_candidate(slow, slow_us)
    handler = Captured()
    tuning.logger.addHandler(handler)
    tuning.logger.setLevel(logging.INFO)
    try:
        calls = tuning.warm_up_until_tuned(lambda: checked_auto_call(rank, world, 5, m, 40, 90))
        return calls, tuning.in_progress(), tuning.decisions(), handler.messages
    finally:
        _C._set_tuner_slow_candidate("", 0)
        tuning.logger.removeHandler(handler)
        os.environ.pop("TORCH_GEMM_AR_AUTOTUNE_REPS")
        os.environ.pop("TORCH_GEMM_AR_AUTOTUNE_MAX_REPS")


def check_race(results, runs):
    """Every rank took the same calls (one per run, one warm-up call per candidate, plus the deciding call) and the
    same decision, with `runs` runs per candidate."""
    for calls, still_tuning, decisions, messages in results:
        assert len(decisions) == 1 and decisions[0]["source"] == "measured", decisions
        assert decisions[0]["candidate_runs"] == runs, decisions
        assert calls == sum(runs.values()) + len(runs) + 1 and not still_tuning, (calls, still_tuning)
    assert results[0][2][0]["algorithm"] == results[1][2][0]["algorithm"]
    return results[0][2][0], results[0][3]


# Every candidate's run padded by 500 ms: fused and sequential (M=5: too few rows for chunked) then cost the same
# (their own times at K=40 N=90 differ by far less than the 2% that takes a candidate out of the race, 10 ms: the
# lower quartile of its runs is a candidate's fastest, and a gloo all_reduce's wake-up tail would have to hit every
# one of them; a smaller padding makes that 2% small enough for such tails to reach), so the budget and the most
# runs per candidate alone end the race. The warm-up round and 3 rounds take 4 s (the warm-up counts against the
# budget); with 5.5 s of budget a fourth round still fits (1 s), a fifth does not.
@pytest.mark.parametrize("budget_ms,runs", [(0, 3), (5_500, 4), (60_000, 6)], ids=["no_budget", "budget", "max_reps"])
def test_candidates_that_cost_the_same_race_within_the_budget(hooked_ranks, tmp_path, budget_ms, runs):
    results = hooked_ranks(2).run(race, str(tmp_path / "t.json"), budget_ms, 3, 6, "*", 500_000, 5)
    decision, _ = check_race(results, {"fused": runs, "sequential": runs})
    assert all(500_000 < t < 600_000 for t in decision["candidate_us"].values()), decision["candidate_us"]


def test_a_clearly_slower_candidate_leaves_the_race(hooked_ranks, tmp_path):
    """With a minute of budget and up to 40 runs, a candidate 100 ms slower than the others (calls well under a
    millisecond) runs the 4 times a candidate runs before it may leave the race, and is not chosen. Its negative
    control is the test above: there every candidate is padded alike, and none leaves the race."""
    results = hooked_ranks(2).run(race, str(tmp_path / "t.json"), 60_000, 3, 40, "sequential", 100_000)
    for calls, still_tuning, decisions, messages in results:
        (decision,) = decisions
        runs = decision["candidate_runs"]
        assert not still_tuning and calls == sum(runs.values()) + len(runs) + 1, (calls, decisions)
        assert decision["candidate_runs"]["sequential"] == 4 and decision["algorithm"] != "sequential", decision
        assert any("sequential" in m and "in 4 runs (out of the race)" in m for m in messages), messages
    assert results[0][2][0]["algorithm"] == results[1][2][0]["algorithm"]


def _warm_up_where_one_rank_still_tunes(rank, world, busy_calls):
    """Rank 0's tuner reports a bucket in progress for its first `busy_calls` questions, the others' report none (as
    ranks whose groups meet different shapes would): every rank must run the same number of steps, or a step's
    collective would wait for a rank that stopped."""
    import torch.distributed as dist

    asked = [0]
    real_in_progress = tuning.in_progress

    def in_progress(group=None):
        asked[0] += 1
        return rank == 0 and asked[0] <= busy_calls

    steps = []

    def step():
        flag = torch.ones(1)
        dist.all_reduce(flag)  # a collective, as a model's step has
        steps.append(int(flag.item()))

    tuning.in_progress = in_progress
    try:
        ran = tuning.warm_up_until_tuned(step, min_steps=1)
    finally:
        tuning.in_progress = real_in_progress
    return ran, steps


def test_warm_up_stops_on_every_rank_together(ranks):
    busy_calls = 3
    results = ranks(2).run(_warm_up_where_one_rank_still_tunes, busy_calls)
    assert results[0] == results[1], f"the ranks ran different steps: {results}"
    assert results[0][0] == 1 + busy_calls, results
