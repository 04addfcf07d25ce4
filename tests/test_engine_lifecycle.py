"""The CPU fused engine as services and frameworks use collectives: several threads, groups set up at the same time,
groups destroyed and rebuilt, fork, a rank interrupted, and a long run whose memory must stop growing."""
import gc
import os
import random
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import torch_gemm_ar
from inputs import TOLERANCE, bias_vector, reference, shard, weight
from scoped_env import scoped_env
from test_fused_engine import SMALL_TILES, shm_entries


# Unit roundoff per dtype. Where bf16/fp16 are computed natively, every rank's partial is rounded to the dtype before
# the sum, so an element may be off by up to (world + 1) roundoffs of the sum of its partials' magnitudes. The long
# run draws such tails, which at K = 1 can exceed the usual tolerance.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def check(out, shards, b, bias=None):
    dtype = shards[0].dtype
    k, world = shards[0].shape[-1], len(shards)
    tol = TOLERANCE[dtype]
    ref = reference(shards, b, bias)
    magnitude = reference([s.abs() for s in shards], b.abs(), None if bias is None else bias.abs())
    bound = tol * ((k * world) ** 0.5 + 1) + tol * ref.abs() + (world + 1) * UNIT_ROUNDOFF[dtype] * magnitude
    error = (out.double() - ref).abs()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    worst = int((error - bound).argmax())  # flat index of the element furthest over its bound
    assert bool((error <= bound).all()), (
        f"{int((error > bound).sum())} of {error.numel()} elements off; at flat index {worst} the error is "
        f"{error.flatten()[worst].item():.3g}, the bound {bound.flatten()[worst].item():.3g}")


def fused_checked(rank, world, seed, group=None, m=37, k=19, n=53, dtype=torch.float32, bias=False, algorithm="fused"):
    shards = [shard(seed, r, m, k, dtype) for r in range(world)]
    b = weight(seed, k, n, dtype, transposed=seed % 2 == 0)
    bias_t = bias_vector(seed, n, dtype) if bias else None
    out = torch_gemm_ar.gemm_allreduce(shards[rank], b, group, bias=bias_t, algorithm=algorithm)
    check(out, shards, b, bias_t)


def run_threads(targets, timeout_s):
    """Runs each callable on its own thread; returns their exceptions (None for success). Bounded."""
    errors = [None] * len(targets)

    def wrap(i):
        try:
            targets[i]()
        except BaseException as e:  # noqa: BLE001  (reported to the caller)
            errors[i] = e

    threads = [threading.Thread(target=wrap, args=(i,), daemon=True) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), f"a caller thread did not finish within {timeout_s}s"
    return errors


def shm_mappings():
    """This process's mappings of engine windows (their names are unlinked once mapped: '(deleted)')."""
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/tgar-" in line for line in f)


def wait_for_mappings(at_most, timeout_s=10.0):
    """This process's window mappings once they are at most `at_most`, or what is left after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while shm_mappings() > at_most and time.monotonic() < deadline:
        time.sleep(0.05)
    return shm_mappings()


def thread_count():
    return len(os.listdir("/proc/self/task"))


# --- problem 1: two groups set up at the same time from two threads ------------------------------------------------


def two_groups_first_calls_together(rank, world, seed, rounds):
    with scoped_env(TORCH_GEMM_AR_CPU_TILE=SMALL_TILES):
        return _two_groups_first_calls_together(rank, world, seed, rounds)


def _two_groups_first_calls_together(rank, world, seed, rounds):
    ranks_list = list(range(world))
    for r in range(rounds):
        groups = [dist.group.WORLD if r == 0 else dist.new_group(ranks_list), dist.new_group(ranks_list)]
        start = threading.Barrier(2)

        def caller(i):
            def body():
                start.wait(10)
                for step in range(3):  # the first call sets the group up; the later ones grow its windows
                    fused_checked(rank, world, seed + 100 * r + 10 * i + step, groups[i], m=20 + 40 * step, n=31 + 7 * i)

            return body

        errors = run_threads([caller(0), caller(1)], timeout_s=60)
        assert errors == [None, None], errors
        for g in groups[1:] if r == 0 else groups:
            dist.destroy_process_group(g)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_two_groups_set_up_concurrently_from_two_threads(ranks, world):
    # 12 rounds: a process-wide lock held while waiting for peers deadlocks setup in some rounds, not in every one.
    result = ranks(world).run(two_groups_first_calls_together, random.randrange(1 << 20), 12, timeout_s=300)
    assert result == [True] * world


def crossed_first_calls(rank, world, process_wide_lock):
    """Rank 0 sets up group A first, rank 1 group B first (the other group's thread starts 1 s later): with one
    process-wide setup lock held while waiting for peers this order deadlocks every time; with per-group setup it
    must not. Returns each thread's error text (None when it succeeded)."""
    from hooked_build import hooked

    groups = [dist.new_group([0, 1]), dist.new_group([0, 1])]
    first = rank % 2  # the group this rank's first thread sets up at once
    with hooked("process_wide_setup_lock", process_wide_lock):
        def caller(i):
            def body():
                if i != first:
                    time.sleep(1.0)
                fused_checked(rank, world, 70 + i, groups[i], m=30, n=20 + i)
            return body

        with scoped_env(TORCH_GEMM_AR_TIMEOUT_S="6"):
            errors = run_threads([caller(0), caller(1)], timeout_s=60)
    return [None if e is None else str(e) for e in errors]


def test_crossed_setup_order_never_deadlocks():
    from hooked_build import hooked_extension_path
    from rank_pool import RankPool

    # Own ranks of the test build: the negative control leaves groups that timed out in setup.
    pool = RankPool(2, extension_path=hooked_extension_path())
    try:
        assert pool.run(crossed_first_calls, False, timeout_s=120) == [[None, None]] * 2
        # Negative control: a process-wide setup lock held while waiting for peers deadlocks this order.
        results = pool.run(crossed_first_calls, True, timeout_s=120)
    finally:
        pool.close(force=True)
    messages = [m for errors in results for m in errors if m is not None]
    assert messages and all("did not arrive" in m for m in messages), results


# --- problem 2: two threads, one group -----------------------------------------------------------------------------


def two_threads_one_group(rank, world, seed, calls):
    group = dist.new_group(list(range(world)))
    outcomes = [[0, 0], [0, 0]]  # per thread: [correct results, disagreement errors]

    def caller(i):
        def body():
            for step in range(calls):
                # Each thread has its own N: a call paired with the other thread's call on a peer disagrees. Such a
                # pair fails on both ranks but advances a different thread on each, so the ranks' step counts drift
                # apart; M = 5 + step keeps two calls of one thread from agreeing unless they are the same step (with
                # M cycling through 40 values, a drift of 40 paired different inputs: a "wrong" sum no library can
                # catch).
                try:
                    fused_checked(rank, world, seed + 1000 * i + step, group, m=5 + step, n=40 + i)
                    outcomes[i][0] += 1
                except ValueError as e:
                    assert "disagree" in str(e), e
                    outcomes[i][1] += 1

        return body

    try:
        errors = run_threads([caller(0), caller(1)], timeout_s=240)
        assert errors == [None, None], errors
        fused_checked(rank, world, seed, group)  # still usable
    finally:
        dist.destroy_process_group(group)  # a failure here must not leave windows to the next test on these ranks
    return outcomes


def test_two_threads_calling_one_group_never_crash(ranks):
    outcomes = ranks(2).run(two_threads_one_group, random.randrange(1 << 20), 300, timeout_s=300)
    for rank_outcomes in outcomes:
        assert sum(sum(t) for t in rank_outcomes) == 2 * 300, outcomes


def same_call_from_two_threads(rank, world, seed, calls):
    """Every call is the same (same shape and inputs), so any pairing across ranks gives the right sum: every call
    must succeed."""
    group = dist.new_group(list(range(world)))
    errors = run_threads([lambda: [fused_checked(rank, world, seed, group) for _ in range(calls)]] * 2, 240)
    dist.destroy_process_group(group)
    assert errors == [None, None], errors


def test_two_threads_same_calls_one_group_all_succeed(ranks):
    ranks(2).run(same_call_from_two_threads, random.randrange(1 << 20), 100, timeout_s=300)


def fused_against_sequential_from_threads(rank, world):
    groups = [dist.new_group(list(range(world))), dist.new_group(list(range(world)))]
    messages = [None, None]

    def caller(i):
        def body():
            algorithm = "fused" if (rank + i) % 2 == 0 else "sequential"
            with pytest.raises(ValueError) as info:
                fused_checked(rank, world, 5, groups[i], algorithm=algorithm)
            messages[i] = str(info.value)
            fused_checked(rank, world, 6, groups[i])  # the group stays usable

        return body

    errors = run_threads([caller(0), caller(1)], timeout_s=60)
    assert errors == [None, None], errors
    for g in groups:
        dist.destroy_process_group(g)
    return messages


def test_fused_against_sequential_from_threads_disagree(ranks):
    for messages in ranks(2).run(fused_against_sequential_from_threads, timeout_s=120):
        for message in messages:
            assert "disagree" in message and "algorithm" in message, message


# --- problem 3: destroyed groups release their windows and threads -------------------------------------------------


def groups_come_and_go(rank, world, seed, rounds):
    fused_checked(rank, world, seed)  # the world group's engine exists throughout
    counts = []
    with scoped_env(TORCH_GEMM_AR_COMM_THREADS="2"):
        for r in range(rounds):
            group = dist.new_group(list(range(world)))
            fused_checked(rank, world, seed + r, group, m=64, n=200)
            counts.append((shm_mappings(), thread_count()))
            dist.destroy_process_group(group)  # unregistered: released even while `group` is still referenced
            if r % 2 == 1:  # (torch keeps an undestroyed group alive itself: destroying comes first)
                del group
                gc.collect()
        # No further call: the engine's reaper releases the last destroyed group within about a second.
        after = (wait_for_mappings(world), thread_count())
        group = dist.new_group(list(range(world)))  # same ranks again: a fresh engine
        fused_checked(rank, world, seed + 999, group, m=70, n=90, bias=True)
        dist.destroy_process_group(group)
    return counts, after


def test_destroyed_groups_release_windows_and_threads(ranks):
    world, rounds = 2, 30
    results = ranks(world).run(groups_come_and_go, random.randrange(1 << 20), rounds, timeout_s=300)
    for counts, after in results:
        maps = [c[0] for c in counts]
        threads = [c[1] for c in counts]
        # world group + the current group + at most one not yet released; never growing with the round count
        assert max(maps) <= 3 * world, maps
        assert maps[-1] <= maps[1], maps
        assert max(threads) <= threads[1] + 2, threads
        assert after[0] <= world, after  # only the world group's windows remain


def default_group_destroyed_and_rebuilt(rank, world, path):
    fused_checked(rank, world, 1)
    before = shm_mappings()
    assert before >= world
    dist.destroy_process_group()
    released = wait_for_mappings(0)  # without another call: the reaper releases every destroyed group
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    fused_checked(rank, world, 2, m=90, n=33)
    return before, released, shm_mappings()


def test_default_group_destroyed_and_rebuilt(tmp_path):
    from rank_pool import RankPool

    pool = RankPool(2)
    try:
        results = pool.run(default_group_destroyed_and_rebuilt, str(tmp_path / "rendezvous"), timeout_s=120)
    finally:
        pool.close(force=True)
    for before, released, after in results:
        assert released == 0, (before, released)  # the old default group's windows were released
        assert after <= before, (before, after)


# --- fork, interrupt -----------------------------------------------------------------------------------------------


def fork_after_setup(rank, world):
    fused_checked(rank, world, 3)
    pid = os.fork()
    if pid == 0:  # the child: must get a clear error, never touch the parent's windows
        code = 3
        try:
            fused_checked(rank, world, 4)
            code = 1
        except RuntimeError as e:
            code = 0 if "fork" in str(e) and "spawn" in str(e) else 2
        except BaseException:  # noqa: BLE001
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    for seed in range(5, 10):  # the parent keeps working
        fused_checked(rank, world, seed)
    return os.waitstatus_to_exitcode(status)


def test_fork_after_setup(ranks):
    assert ranks(2).run(fork_after_setup, timeout_s=120) == [0, 0]


def interrupted_then_exit(rank, world, victim, timeout_s):
    fused_checked(rank, world, 1, m=300, n=200)
    if rank == victim:
        # Python's own Ctrl-C behaviour, whatever this process inherited: started as a background job of a
        # non-interactive shell (as CI may start the suite), a process has SIGINT ignored, and Python keeps it so.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C between calls
            # Short sleeps: the kernel may hand the signal to another thread, and then only the interpreter's next
            # check (here the loop's) raises KeyboardInterrupt in the main thread; one long sleep once outlasted it.
            for _ in range(50):
                time.sleep(0.1)
        except KeyboardInterrupt:
            os._exit(130)  # the rank exits (as an uncaught KeyboardInterrupt would end it)
        return "not interrupted"
    start = time.monotonic()
    with scoped_env(TORCH_GEMM_AR_TIMEOUT_S=str(timeout_s)):
        try:
            for seed in range(2, 50):
                fused_checked(rank, world, seed, m=300, n=200)
        except (RuntimeError, ValueError) as e:  # ValueError: a peer gave up first ("rank 1 abandoned call ...")
            return str(e), time.monotonic() - start
    return None


def test_keyboard_interrupt_then_exit(tmp_path):
    from rank_pool import RankPool

    pool = RankPool(3)
    try:
        pids = [p.pid for p in pool.procs]
        results = pool.run(interrupted_then_exit, 2, 20.0, timeout_s=120, tolerate_deaths=True)
    finally:
        pool.close(force=True)
    assert results[2] is None, results[2]
    for rank in (0, 1):
        assert results[rank] is not None, f"rank {rank} never noticed that rank 2 left"
        message, elapsed = results[rank]
        # Every survivor names the rank that left, also the one that learnt of it from the other's abandon.
        assert "rank 2" in message and "died" in message, results
        assert elapsed < 20.0 + 5.0, f"rank {rank} took {elapsed:.1f}s (timeout 20s)"
    assert shm_entries(pids) == [], "shared-memory names left behind"


# --- long run ------------------------------------------------------------------------------------------------------


def rss_mib():
    # Freed heap pages back to the system first: RSS then counts what the process holds, not what glibc keeps cached
    # after frees, which can add a late step that looks like growth.
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def long_run(rank, world, seed, calls):
    rng = random.Random(seed)
    rss = []
    with scoped_env(TORCH_GEMM_AR_CPU_TILE=SMALL_TILES):
        for step in range(calls):
            m, k, n = rng.randint(1, 120), rng.randint(1, 48), rng.randint(1, 130)
            dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
            algorithm = rng.choice(["fused", "fused", "auto", "sequential", "chunked"])
            fused_checked(rank, world, seed + step, m=m, k=k, n=n, dtype=dtype, bias=rng.random() < 0.5,
                          algorithm=algorithm)
            if step % 500 == 499:
                rss.append(rss_mib())
    return rss


@pytest.mark.slow
def test_long_run_stays_correct_and_memory_stops_growing():
    # 40,000 calls (changing shapes, dtypes, bias, algorithms), each checked against float64. RSS levels off after
    # the first few thousand calls (the allocator and the capped output cache warming up to the random shapes), so the
    # last 20,000 must add under 8 MiB. The output cache is capped at 16 MB in these ranks (own pool, the cap is
    # read once per process): with the default 512 MB cap, the cache of exact-size buffers for ever new random
    # shapes fills for longer before it levels off.
    from rank_pool import RankPool

    calls = 40000
    with scoped_env(TORCH_GEMM_AR_OUTPUT_CACHE_MB="16"):
        pool = RankPool(2)
    try:
        results = pool.run(long_run, random.randrange(1 << 20), calls, timeout_s=900)
    finally:
        pool.close()
    for rank, rss in enumerate(results):
        print(f"rank {rank} RSS MiB every 500 calls: {[round(v) for v in rss]}")  # shown with pytest -s
        last = rss[-(20000 // 500) - 1:]
        assert max(last) - last[0] < 8.0, f"RSS kept growing after warm-up (MiB every 500 calls): {rss}"
