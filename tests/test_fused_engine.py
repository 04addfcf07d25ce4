"""The CPU fused engine under stress: thousands of back-to-back calls with fresh inputs and changing shapes, two
groups used alternately, a rank killed mid-call, nothing left in /dev/shm, and a negative control showing that the
stress test catches a protocol bug."""
import os
import random
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import torch_gemm_ar
from hooked_build import hooked
from inputs import TOLERANCE, bias_vector, reference, shard, weight
from scoped_env import scoped_env

# Small tiles so that small shapes still make many tiles, subtiles, owners and queue entries.
SMALL_TILES = "16,32,8"




def random_case(seed, step, world):
    rng = random.Random(seed * 1_000_003 + step)
    m, k, n = rng.randint(1, 90), rng.randint(1, 40), rng.randint(1, 110)
    dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16])
    return m, k, n, dtype, rng.random() < 0.5, rng.random() < 0.5


def stress(rank, world, seed, calls, slow_rank=None, comm_threads="0"):
    """Back-to-back fused calls, each with new inputs and a new shape; returns how many results were wrong.
    comm_threads "0": comm work between tiles on the caller's thread; "N": N comm threads (N comm blocks)."""
    wrong = 0
    with scoped_env(TORCH_GEMM_AR_CPU_TILE=SMALL_TILES, TORCH_GEMM_AR_COMM_THREADS=comm_threads):
        for step in range(calls):
            m, k, n, dtype, with_bias, transposed = random_case(seed, step, world)
            shards = [shard(seed + step, r, m, k, dtype) for r in range(world)]
            b = weight(seed + step, k, n, dtype, transposed)
            bias = bias_vector(seed + step, n, dtype) if with_bias else None
            if rank == slow_rank:
                time.sleep(0.0005)
            out = torch_gemm_ar.gemm_allreduce(shards[rank], b, bias=bias, algorithm="fused")
            ref = reference(shards, b, bias)
            tol = TOLERANCE[dtype]
            if not torch.allclose(out.double(), ref, rtol=tol, atol=tol * ((k * world) ** 0.5 + 1)):
                wrong += 1
    return wrong


@pytest.mark.parametrize("comm_threads", ["0", "1", "3"])
@pytest.mark.parametrize("world,calls", [(2, 2000), (3, 700), (4, 400)])
def test_back_to_back_stress(ranks, world, calls, comm_threads):
    wrong = ranks(world).run(stress, random.randrange(1 << 30), calls, comm_threads=comm_threads, timeout_s=600)
    assert wrong == [0] * world, f"wrong results per rank: {wrong}"


def stress_ignoring_epochs(rank, world, seed, calls, comm_threads):
    with hooked("ignore_epochs", True):
        return stress(rank, world, seed, calls, slow_rank=1, comm_threads=comm_threads)


@pytest.mark.parametrize("comm_threads", ["0", "1"])
def test_negative_control_stress_catches_ignored_epochs(hooked_ranks, comm_threads):
    """With a deliberate protocol bug (stale flags of earlier calls count as ready) the same stress test must
    report wrong results: evidence that it would catch a real ordering bug."""
    wrong = hooked_ranks(2).run(stress_ignoring_epochs, random.randrange(1 << 30), 300, comm_threads, timeout_s=600)
    assert sum(wrong) > 0, "the stress test did not notice a protocol that ignores epochs"
    # The engine is fine again once the bug is switched off.
    assert hooked_ranks(2).run(stress, random.randrange(1 << 30), 50) == [0, 0]


def alternate_groups(rank, world, seed):
    reverse = dist.new_group(list(range(world)))  # same ranks, second group: its own windows and call counter
    pair = dist.new_group([0, 1])
    with scoped_env(TORCH_GEMM_AR_CPU_TILE=SMALL_TILES):
        for step in range(120):
            m, k, n, dtype, with_bias, transposed = random_case(seed, step, world)
            shards = [shard(seed + step, r, m, k, dtype) for r in range(world)]
            b = weight(seed + step, k, n, dtype, transposed)
            group = [dist.group.WORLD, reverse][step % 2]
            out = torch_gemm_ar.gemm_allreduce(shards[rank], b, group, algorithm="fused")
            torch.testing.assert_close(out.double(), reference(shards, b), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * 10)
            if rank < 2 and step % 3 == 0:
                out = torch_gemm_ar.gemm_allreduce(shards[rank], b, pair, algorithm="fused")
                torch.testing.assert_close(
                    out.double(), reference(shards[:2], b), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * 10
                )


def test_two_groups_used_alternately(ranks):
    ranks(3).run(alternate_groups, random.randrange(1 << 30), timeout_s=300)


def shm_entries(pids):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("tgar-") and any(f"-{p}-" in f"-{n}" for p in pids))


def kill_mid_call(rank, world, victim, timeout_s):
    """A long fused call during which `victim` kills itself with SIGKILL."""
    shards = [shard(7, r, 2048, 512, torch.float32) for r in range(world)]
    b = weight(7, 512, 1024, torch.float32, transposed=True)
    torch_gemm_ar.gemm_allreduce(shards[rank], b, algorithm="fused")  # windows set up and grown first
    if rank == victim:
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    with scoped_env(TORCH_GEMM_AR_TIMEOUT_S=str(timeout_s)):
        try:
            for _ in range(50):
                torch_gemm_ar.gemm_allreduce(shards[rank], b, algorithm="fused")
        except RuntimeError as e:
            elapsed = time.monotonic() - start
            # The process stays usable for non-fused work; the broken group says why fused is gone.
            assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).sum().item() == 8.0
            with pytest.raises(RuntimeError, match="earlier failure"):
                torch_gemm_ar.gemm_allreduce(shards[rank], b, algorithm="fused")
            return str(e), elapsed
    return None


def test_rank_killed_mid_call(tmp_path):
    from rank_pool import RankPool

    pool = RankPool(3)
    try:
        pids = [p.pid for p in pool.procs]
        results = pool.run(kill_mid_call, 2, 20.0, timeout_s=120, tolerate_deaths=True)
    finally:
        pool.close(force=True)
    assert results[2] is None, "the victim should have died"
    for rank in (0, 1):
        assert results[rank] is not None, f"rank {rank} never noticed the death"
        message, elapsed = results[rank]
        assert "rank 2" in message and "died" in message, message
        assert elapsed < 20.0, f"rank {rank} took {elapsed:.1f}s (timeout 20s)"
    assert shm_entries(pids) == [], "shared-memory windows left behind after SIGKILL"


def window_names_in_use(rank, world):
    torch_gemm_ar.gemm_allreduce(torch.randn(300, 20), torch.randn(20, 700), algorithm="fused")
    return os.getpid()


def test_nothing_left_in_dev_shm(ranks):
    pids = ranks(2).run(window_names_in_use)
    assert shm_entries(pids) == []
