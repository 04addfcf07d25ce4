"""The CPU engine's tiles for gemm_reduce_scatter and allgather_gemm on one-core ranks (cpu/call_geometry.h): where
the products reorder all of B per call (bf16/fp16 computed natively), one full-width tile row per rank's chunk; and
allgather_gemm multiplying B's packed panels (fp32), packed once per call instead of once per tile. The rule for
every dtype and switch mode; results against float64 with the rule forced on for every dtype (so that CPUs without
native bf16 test it too), on shapes that are not multiples of any tile, 2-D and 3-D sharded along each row dim,
world 2 and 3, with bias; which ranks multiply AG+GEMM's rows in one product when one rank is late; back-to-back
stress with new shapes every call and a late rank (both ways of AG+GEMM taken), and its negative control."""
import contextlib
import os
import random
import time

import pytest
import torch

from inputs import assert_matches
from scoped_env import engine_switch
from test_fewer_b_reorders import EVERY_DTYPE, NATIVE_HALF, ONE_CORE, each_switch_mode
from test_sequence_parallel_fused import allgather_case, reduce_scatter_case, stress, stress_ignoring_epochs
from torch_gemm_ar import _C
from engine_observation_build import observe


def test_the_rule(one_core_env):
    previous = _C._set_engine_option("fewer_b_reorders", NATIVE_HALF)
    try:
        for dtype, like, mode, takes in each_switch_mode():
            for m, n, world in ((2048, 1024, 2), (3 * 517, 700, 3)):
                per_rank = observe.tile_row_per_rank_geometry(m, n, world)
                rs = observe.call_geometry("gemm_reduce_scatter", m, 256, n, like, world)
                ag = observe.call_geometry("allgather_gemm", m, 256, n, like, world)
                # M / world rows (rounded up to the 16-row stripes) and every column in one tile.
                assert per_rank[0] >= m // world and per_rank[1] >= n
                assert rs == (per_rank if takes else observe.wide_row_geometry(m, n, world)), (dtype, mode, m)
                assert (ag == per_rank) == takes, (dtype, mode, m)
                # allgather_gemm multiplies all rows at once where they are all in; gemm_reduce_scatter never.
                assert observe.call_multiplies_in_one_product("allgather_gemm", m, 256, n, like, world) == takes
                assert not observe.call_multiplies_in_one_product("gemm_reduce_scatter", m, 256, n, like, world)
        with pytest.raises(ValueError, match="multiple of world"):
            observe.call_geometry("allgather_gemm", 1001, 8, 8, torch.empty(0), 2)
    finally:
        _C._set_engine_option("fewer_b_reorders", previous)


@contextlib.contextmanager
def engine_rules(mode=EVERY_DTYPE):
    """In a rank: one-core settings, no tile from the environment (the geometry rules decide) and the switch in
    `mode` (EVERY_DTYPE: one tile row per rank's chunk in every dtype)."""
    saved_tile = os.environ.pop("TORCH_GEMM_AR_CPU_TILE", None)
    try:
        with engine_switch("fewer_b_reorders", mode, **ONE_CORE):
            yield
    finally:
        if saved_tile is not None:
            os.environ["TORCH_GEMM_AR_CPU_TILE"] = saved_tile


def forced_results(rank, world, seed, dtype):
    """Both ops with one tile row per rank's chunk forced on, every layout; returns the cases checked."""
    checked = 0
    with engine_rules():
        for li, (shape_of, dim, k, n) in enumerate([
                (lambda k: (world * 301, k), 0, 67, 1030),  # 2-D: chunks of 301 rows, tiles of 304
                (lambda k: (world * 37, k), 0, 300, 20),     # a long K against a narrow N
                (lambda k: (3, world * 45, k), 1, 33, 515),  # 3-D along dim 1: one chunk per (batch, rank)
                (lambda k: (world * 2, 23, k), 0, 19, 260)]):  # 3-D along dim 0
            for with_bias in (False, True):
                s = seed + 100 * li + with_bias
                what = f"{shape_of(k)} dim={dim} k={k} n={n} bias={with_bias} {dtype}"
                out, want = reduce_scatter_case(rank, world, s, dtype, shape_of, dim, k, n, with_bias)
                assert_matches(out, want, dtype, k, world, "gemm_reduce_scatter " + what)
                out, want, gathered, whole = allgather_case(rank, world, s, dtype, shape_of, dim, k, n, with_bias)
                assert torch.equal(gathered, whole), "allgather_gemm: gathered a is not the concatenation " + what
                assert_matches(out, want, dtype, k, 1, "allgather_gemm " + what)
                checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_results_match_float64(ranks, world, dtype):
    assert ranks(world).run(forced_results, random.randrange(1 << 20), dtype, timeout_s=600) == [8] * world


def forced_stress(rank, world, seed, calls, ignore_epochs=False):
    """(wrong results, allgather_gemm calls in one product) of a stress run with the engine's own tiles, sharded dims
    20x the base case's (chunks of up to 1000 rows, one tile row each; gemm_allreduce calls in between take their own
    geometries)."""
    with engine_rules():
        before = observe.one_product_calls()
        if ignore_epochs:
            wrong = stress_ignoring_epochs(rank, world, seed, calls, "0", tiles=None, scale_rows=20)
        else:
            wrong = stress(rank, world, seed, calls, "0", slow_rank=world - 1, tiles=None, scale_rows=20)
        return wrong, observe.one_product_calls() - before


@pytest.mark.parametrize("world,calls", [(2, 400), (3, 150)])
def test_back_to_back_stress(ranks, world, calls):
    results = ranks(world).run(forced_stress, random.randrange(1 << 30), calls, timeout_s=900)
    wrong = [w for w, _ in results]
    assert wrong == [0] * world, f"wrong results per rank: {wrong}"
    if world == 2:  # ranks that share the two cores arrive together often enough for both ways to run
        assert sum(took for _, took in results) > 0, "no allgather_gemm call took the one product"


def test_negative_control_stress_catches_ignored_epochs(hooked_ranks):
    """With stale flags of earlier calls taken as ready, the same stress run must report wrong results."""
    results = hooked_ranks(2).run(forced_stress, random.randrange(1 << 30), 300, True, timeout_s=900)
    assert sum(w for w, _ in results) > 0, "the stress test did not notice a protocol that ignores epochs"


def one_product_takers(rank, world, seed, late_rank):
    """Which allgather_gemm calls multiplied all rows in one product: with `late_rank` 150 ms late, the others find its
    rows missing (tile by tile), it finds every peer's rows in (one product). A first call of the same shape, not
    counted, sets up the engine and its windows (which synchronise the ranks). Results checked against float64."""
    took = []
    with engine_rules():
        for i in range(4):
            if rank == late_rank and i > 0:
                time.sleep(0.15)
            before = observe.one_product_calls()
            # One signature for all four (a call whose signature differs from the last one's is checked by every
            # rank before any publishes: the ranks would arrive together).
            out, want, _, _ = allgather_case(rank, world, seed + i, torch.bfloat16, lambda k: (world * 70, k), 0,
                                             40, 300, True)
            if i > 0:
                took.append(observe.one_product_calls() - before)
            assert_matches(out, want, torch.bfloat16, 40, 1, "allgather_gemm, one product or tile by tile")
    return took


def test_allgather_gemm_takes_one_product_where_every_rank_s_rows_are_in(ranks):
    # Two ranks on two cores; a rank descheduled for 150 ms (a loaded CI machine) may still swap the roles of one
    # call, so two of three calls must show them (always or never taken fails).
    early, late = ranks(2).run(one_product_takers, random.randrange(1 << 20), 1)
    assert sum(late) >= 2 and sum(early) <= 1, f"one-product calls per call: early rank {early}, late rank {late}"


def packed_panels_of_allgather_calls(rank, world, seed):
    """Packed B panels made by fp32 allgather_gemm calls of two tile rows per rank and more (the default rules)."""
    before = observe.packed_b_panels()
    with engine_rules(NATIVE_HALF):
        for i in range(3):
            out, want, _, _ = allgather_case(rank, world, seed + i, torch.float32, lambda k: (world * 600, k), 0,
                                             96, 1100, i == 1)
            assert_matches(out, want, torch.float32, 96, 1, "allgather_gemm with packed B panels")
    return observe.packed_b_panels() - before


def test_allgather_gemm_packs_b_panels_once_per_call(ranks):
    if not observe.packed_b_available():
        pytest.skip("torch's BLAS has no packed GEMM (not a oneMKL build): the engine multiplies through at::mm")
    panels = ranks(2).run(packed_panels_of_allgather_calls, random.randrange(1 << 20))
    # Default tiles (256 x 512 at N 1100: 3 panels), 1200 gathered rows: 5 tile rows share each panel.
    assert all(p == 3 * 3 for p in panels), f"B panels packed per rank: {panels}"
