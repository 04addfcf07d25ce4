"""gemm_reduce_scatter and allgather_gemm on the CPU fused engine (algorithm="fused"): results against float64 on
fresh random inputs (world 1-4, odd shapes, bias, 2-D and 3-D sharded along each row dim, fp32/bf16), the gathered
a, gradients, `auto`, thousands of back-to-back calls alternating ops and shapes (also with gemm_allreduce in
between), a negative control that breaks the protocol on purpose, and nothing left in /dev/shm."""
import os
import random

import pytest
import torch

import torch_gemm_ar
from hooked_build import hooked
from inputs import TOLERANCE, assert_matches
from test_sequence_parallel_ops import SIZES, allgather_grads, layouts, randn, reduce_scatter_grads
from scoped_env import scoped_env

# Small tiles so that small shapes still make many tiles, tile rows per chunk, stripes and comm items.
SMALL_TILES = "16,32,8"




def reduce_scatter_case(rank, world, seed, dtype, shape_of, dim, k, n, with_bias, algorithm="fused"):
    shards = [randn(seed * 31 + r, *shape_of(k), dtype=dtype) for r in range(world)]
    weights = [randn(seed * 37 + r, k, n, dtype=dtype) for r in range(world)]
    bias = randn(seed * 41, n, dtype=dtype) if with_bias else None
    out = torch_gemm_ar.gemm_reduce_scatter(shards[rank], weights[rank], scatter_dim=dim, bias=bias,
                                            algorithm=algorithm)
    full = sum(a.double() @ w.double() for a, w in zip(shards, weights))
    if bias is not None:
        full = full + bias.double()
    return out, full.chunk(world, dim=dim)[rank]


def allgather_case(rank, world, seed, dtype, shape_of, dim, k, n, with_bias, algorithm="fused"):
    shard_shape = list(shape_of(k))
    shard_shape[dim] //= world
    shards = [randn(seed * 31 + r, *shard_shape, dtype=dtype) for r in range(world)]
    w = randn(seed * 37 + rank, k, n, dtype=dtype)
    bias = randn(seed * 41 + rank, n, dtype=dtype) if with_bias else None
    out, gathered = torch_gemm_ar.allgather_gemm(shards[rank], w, gather_dim=dim, bias=bias, return_gathered=True,
                                                 algorithm=algorithm)
    whole = torch.cat(shards, dim=dim)
    want = whole.double() @ w.double()
    if bias is not None:
        want = want + bias.double()
    return out, want, gathered, whole


def fused_results(rank, world, seed, dtype, tiles):
    """Every layout and size through both fused ops; returns how many cases were checked."""
    checked = 0
    with scoped_env(TORCH_GEMM_AR_CPU_TILE=tiles):
        for li, (shape_of, dim) in enumerate(layouts(world)):
            for ki, (k, n) in enumerate(SIZES):
                for with_bias in (False, True):
                    s = seed + 1000 * li + 10 * ki + with_bias
                    what = f"layout {li} dim={dim} k={k} n={n} bias={with_bias}"
                    out, want = reduce_scatter_case(rank, world, s, dtype, shape_of, dim, k, n, with_bias)
                    assert_matches(out, want, dtype, k, world, "fused gemm_reduce_scatter " + what)
                    out, want, gathered, whole = allgather_case(rank, world, s, dtype, shape_of, dim, k, n, with_bias)
                    assert torch.equal(gathered, whole), "fused allgather_gemm: gathered a is not the concatenation"
                    assert_matches(out, want, dtype, k, 1, "fused allgather_gemm " + what)
                    checked += 1
    return checked


# float16: computed in fp32 on CPUs without avx512_fp16/amx_fp16, so the gathered rows of allgather_gemm are converted
# as they arrive (LocalGemm::refresh_rows).
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fused_matches_float64(ranks, world, dtype):
    counts = ranks(world).run(fused_results, random.randrange(1 << 20), dtype, SMALL_TILES, timeout_s=600)
    assert all(c == 48 for c in counts), counts


def large_fused_results(rank, world, seed, dtype):
    """Default tiles (256 x 512): rows that straddle tile boundaries inside each rank's chunk, 3-D along dim 1."""
    for shape_of, dim, k, n in [(lambda k: (world * 300, k), 0, 129, 1100),
                                (lambda k: (2, world * 260, k), 1, 70, 515)]:
        for with_bias in (False, True):
            out, want = reduce_scatter_case(rank, world, seed, dtype, shape_of, dim, k, n, with_bias)
            assert_matches(out, want, dtype, k, world, f"fused gemm_reduce_scatter {shape_of(k)} dim={dim}")
            out, want, gathered, whole = allgather_case(rank, world, seed, dtype, shape_of, dim, k, n, with_bias)
            assert torch.equal(gathered, whole)
            assert_matches(out, want, dtype, k, 1, f"fused allgather_gemm {shape_of(k)} dim={dim}")


@pytest.mark.parametrize("world", [2, 3])
def test_fused_default_tiles(ranks, world):
    ranks(world).run(large_fused_results, random.randrange(1 << 20), torch.float32, timeout_s=600)


def fused_without_return_gathered(rank, world, seed):
    shards = [randn(seed + r, 3, 2 * world, 9, dtype=torch.float32) for r in range(world)]
    w = randn(seed + 99, 9, 7, dtype=torch.float32)
    out = torch_gemm_ar.allgather_gemm(shards[rank], w, gather_dim=0, algorithm="fused")
    assert isinstance(out, torch.Tensor) and out.shape == (3 * world, 2 * world, 7)
    torch.testing.assert_close(out.double(), torch.cat(shards).double() @ w.double(), rtol=3e-5, atol=1e-4)
    # No rows: nothing to multiply, every rank still agrees and returns the empty result.
    empty = torch_gemm_ar.gemm_reduce_scatter(torch.zeros(0, 9), w, algorithm="fused")
    assert empty.shape == (0, 7)
    out, gathered = torch_gemm_ar.allgather_gemm(torch.zeros(0, 9), w, return_gathered=True, algorithm="fused")
    assert out.shape == (0, 7) and gathered.shape == (0, 9)


def test_fused_return_value_forms_and_empty_inputs(ranks):
    ranks(2).run(fused_without_return_gathered, random.randrange(1 << 20))


def fused_grads(rank, world, seed, dtype, shard_shape, dim):
    with scoped_env(TORCH_GEMM_AR_CPU_TILE=SMALL_TILES):
        whole = list(shard_shape)
        whole[dim] *= world
        reduce_scatter_grads(rank, world, seed, dtype, tuple(whole), dim, algorithm="fused")
        allgather_grads(rank, world, seed, dtype, shard_shape, dim, algorithm="fused")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,dim", [((19, 13), 0), ((2, 5, 9), 0), ((3, 7, 9), 1)], ids=["2d", "3d-dim0", "3d-dim1"])
def test_fused_gradients_match_float64(ranks, world, dtype, shape, dim):
    """Forward and backward (the other op, also fused) against float64 autograd."""
    ranks(world).run(fused_grads, random.randrange(1 << 20), dtype, shape, dim)


def auto_results(rank, world, seed):
    """`auto` (measured tuner: sequential vs fused) gives the right answer on every call while it tunes and after."""
    shape_of, dim = (lambda k: (world * 40, k), 0)
    for step in range(torch_gemm_ar.tuning.calls_to_decide() + 2):  # tuning calls, the decision, decided calls
        out, want = reduce_scatter_case(rank, world, seed + step, torch.float32, shape_of, dim, 33, 65, True,
                                        algorithm="auto")
        assert_matches(out, want, torch.float32, 33, world, f"auto gemm_reduce_scatter step {step}")
        out, want, gathered, whole = allgather_case(rank, world, seed + step, torch.float32, shape_of, dim, 33, 65,
                                                    True, algorithm="auto")
        assert torch.equal(gathered, whole)
        assert_matches(out, want, torch.float32, 33, 1, f"auto allgather_gemm step {step}")
    ops = ("op=1;", "op=2;")  # gemm_reduce_scatter, allgather_gemm
    return sorted((d["bucket"].split(";")[0], d["algorithm"]) for d in torch_gemm_ar.tuning.decisions()
                  if d["bucket"].startswith(ops))


def test_auto_tunes_between_sequential_and_fused(ranks):
    decided = ranks(2).run(auto_results, random.randrange(1 << 20), timeout_s=300)
    assert decided[0] == decided[1], decided  # every rank decides alike
    assert [op for op, _ in decided[0]] == ["op=1", "op=2"], decided  # one decision per op
    assert {algorithm for _, algorithm in decided[0]} <= {"sequential", "fused"}, decided


def random_stress_case(seed, step, world):
    rng = random.Random(seed * 1_000_003 + step)
    op = rng.choice(["rs", "ag", "ag", "rs", "ar"])
    three_d = rng.random() < 0.5
    dim = rng.choice([0, 1]) if three_d else 0
    k, n = rng.randint(1, 40), rng.randint(1, 110)
    if three_d:
        shape = [rng.randint(1, 3), rng.randint(1, 12), k]
    else:
        shape = [rng.randint(1, 50), k]
    dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16])
    return op, shape, dim, k, n, dtype, rng.random() < 0.5


def stress(rank, world, seed, calls, comm_threads, slow_rank=None, compute_threads="1", tiles=SMALL_TILES,
           scale_rows=1):
    """Back-to-back fused calls alternating gemm_reduce_scatter, allgather_gemm and gemm_allreduce with new inputs and
    shapes every call (the sharded dim's size times `scale_rows`); returns how many results were wrong. tiles=None:
    the engine's own geometry rules (the caller keeps TORCH_GEMM_AR_CPU_TILE unset)."""
    wrong = 0
    tile_env = {"TORCH_GEMM_AR_CPU_TILE": tiles} if tiles else {}
    with scoped_env(TORCH_GEMM_AR_COMM_THREADS=comm_threads, TORCH_GEMM_AR_COMPUTE_THREADS=compute_threads,
                    **tile_env):
        for step in range(calls):
            op, shape, dim, k, n, dtype, with_bias = random_stress_case(seed, step, world)
            shape[dim] *= scale_rows
            s = seed * 7 + step
            if rank == slow_rank and step % 3 == 0:
                import time
                time.sleep(0.0005)
            if op == "rs":
                whole = list(shape)
                whole[dim] *= world
                out, want = reduce_scatter_case(rank, world, s, dtype, lambda _k: whole, dim, k, n, with_bias)
                scale = world
            elif op == "ag":
                whole = list(shape)
                whole[dim] *= world
                out, want, gathered, expected = allgather_case(rank, world, s, dtype, lambda _k: whole, dim, k, n,
                                                               with_bias)
                wrong += not torch.equal(gathered, expected)
                scale = 1
            else:
                shards = [randn(s * 31 + r, *shape, dtype=dtype) for r in range(world)]
                weights = [randn(s * 37 + r, k, n, dtype=dtype) for r in range(world)]
                out = torch_gemm_ar.gemm_allreduce(shards[rank], weights[rank], algorithm="fused")
                want = sum(a.double() @ w.double() for a, w in zip(shards, weights))
                scale = world
            tol = TOLERANCE[dtype]
            if out.shape != want.shape or not torch.allclose(out.double(), want, rtol=tol,
                                                             atol=tol * ((k * scale) ** 0.5 + 1)):
                wrong += 1
    return wrong


@pytest.mark.parametrize("comm_threads", ["0", "1", "2"])
@pytest.mark.parametrize("world,calls", [(2, 1500), (3, 500), (4, 300)])
def test_back_to_back_stress(ranks, world, calls, comm_threads):
    wrong = ranks(world).run(stress, random.randrange(1 << 30), calls, comm_threads, slow_rank=world - 1,
                             timeout_s=900)
    assert wrong == [0] * world, f"wrong results per rank: {wrong}"


def test_stress_with_several_compute_blocks(ranks):
    """Two compute blocks (tiles dealt round-robin between them; allgather_gemm's wait for peer rows in each) and two
    comm blocks."""
    wrong = ranks(2).run(stress, random.randrange(1 << 30), 600, "2", slow_rank=0, compute_threads="2",
                         timeout_s=900)
    assert wrong == [0, 0], f"wrong results per rank: {wrong}"


def stress_ignoring_epochs(rank, world, seed, calls, comm_threads, **stress_args):
    with hooked("ignore_epochs", True):
        return stress(rank, world, seed, calls, comm_threads, slow_rank=1, **stress_args)


@pytest.mark.parametrize("comm_threads", ["0", "1"])
def test_negative_control_stress_catches_ignored_epochs(hooked_ranks, comm_threads):
    """With a deliberate protocol bug (stale flags of earlier calls count as ready: a shard row or a reduced tile is
    read before its rank wrote it) the same stress test must report wrong results."""
    wrong = hooked_ranks(2).run(stress_ignoring_epochs, random.randrange(1 << 30), 400, comm_threads, timeout_s=900)
    assert sum(wrong) > 0, "the stress test did not notice a protocol that ignores epochs"
    assert hooked_ranks(2).run(stress, random.randrange(1 << 30), 60, comm_threads) == [0, 0]


def owner_last_case(rank, world, seed, op, dtype, shape, dim, k, n, with_bias):
    """(outputs, float64 references) of one fused call of `op` on fresh inputs."""
    if op == "rs":
        out, want = reduce_scatter_case(rank, world, seed, dtype, lambda _k: shape, dim, k, n, with_bias)
        return [out], [want]
    shards = [randn(seed * 31 + r, *shape, dtype=dtype) for r in range(world)]
    weights = [randn(seed * 37 + r, k, n, dtype=dtype) for r in range(world)]
    bias = randn(seed * 41, n, dtype=dtype) if with_bias else None
    reduced = sum(a.double() @ w.double() for a, w in zip(shards, weights))
    if bias is not None:
        reduced = reduced + bias.double()
    if op == "ar":
        return [torch_gemm_ar.gemm_allreduce(shards[rank], weights[rank], bias=bias, algorithm="fused")], [reduced]
    residual = randn(seed * 43, *reduced.shape, dtype=dtype)
    weight = randn(seed * 47, n, dtype=dtype)
    out, normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm(shards[rank], weights[rank], residual, weight, bias=bias,
                                                           eps=1e-6, algorithm="fused")
    want = reduced + residual.double()
    # The reference normalises the rounded sum, as the op does (its out is rounded to the call's dtype first).
    rounded = out.double()
    want_normed = rounded * torch.rsqrt(rounded.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    return [out, normed], [want, want_normed]


def owner_last_against_comm_block(rank, world, seed, calls, ways=(True, False)):
    """One core per rank (comm between tiles): the owner reduces its own tiles in the compute block
    (owner_last_compute.cpp) or, switched off, through the comm block as with comm threads; gemm_reduce_scatter,
    gemm_allreduce and gemm_allreduce_add_rmsnorm. Both ways must give the same bits (same reduction order) and
    match float64; returns how many calls differed or were wrong."""
    from torch_gemm_ar import _C

    bad = 0
    rng = random.Random(seed)
    with scoped_env(TORCH_GEMM_AR_CPU_TILE=SMALL_TILES, TORCH_GEMM_AR_COMM_THREADS="0"):
        try:
            for step in range(calls):
                three_d = rng.random() < 0.5
                dim = rng.choice([0, 1]) if three_d else 0
                k, n = rng.randint(1, 40), rng.randint(1, 110)
                shape = [rng.randint(1, 3), rng.randint(1, 12), k] if three_d else [rng.randint(1, 50), k]
                shape[dim] *= world
                dtype = rng.choice([torch.float32, torch.bfloat16])
                with_bias = rng.random() < 0.5
                op = rng.choice(["rs", "ar", "ar_norm"])
                results = []
                for owner_last in ways:
                    _C._set_engine_option("owner_last", owner_last)
                    outs, wants = owner_last_case(rank, world, seed + step, op, dtype, shape, dim, k, n, with_bias)
                    tol = TOLERANCE[dtype]
                    for out, want in zip(outs, wants):
                        bad += not torch.allclose(out.double(), want, rtol=tol, atol=tol * ((k * world) ** 0.5 + 1))
                    results.append(torch.cat([o.reshape(-1) for o in outs]))
                bad += not all(torch.equal(results[0], other) for other in results[1:])
        finally:
            _C._set_engine_option("owner_last", True)
    return bad


@pytest.mark.parametrize("world", [2, 3])
def test_owner_last_reduce_scatter_is_bitwise_the_comm_block_way(ranks, world):
    bad = ranks(world).run(owner_last_against_comm_block, random.randrange(1 << 30), 150, timeout_s=600)
    assert bad == [0] * world, f"calls that differed between the two ways or were wrong, per rank: {bad}"


def owner_last_ignoring_epochs(rank, world, seed, calls):
    with hooked("ignore_epochs", True):
        return owner_last_against_comm_block(rank, world, seed, calls, ways=(True,))


def test_negative_control_owner_last_reads_stale_partials(hooked_ranks):
    """With stale tile flags counted as ready, the owner-last reduction reads peers' partials of an earlier call:
    the same check must see wrong results."""
    bad = hooked_ranks(2).run(owner_last_ignoring_epochs, random.randrange(1 << 30), 300, timeout_s=600)
    assert sum(bad) > 0, "the owner-last check did not notice a reduction that ignores epochs"


def shm_names():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("tgar-"))


def window_names_after_calls(rank, world, seed):
    fused_results(rank, world, seed, torch.float32, SMALL_TILES)
    return [n for n in shm_names() if f"-{os.getpid()}-" in f"-{n}"]


def test_nothing_left_in_dev_shm(ranks):
    left = ranks(3).run(window_names_after_calls, random.randrange(1 << 20), timeout_s=600)
    assert left == [[], [], []], left
