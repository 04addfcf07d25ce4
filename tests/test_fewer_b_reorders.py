"""Geometries with fewer tile rows on one-core ranks, for products that reorder all of B per call (bf16/fp16 computed
natively through oneDNN; cpu/engine_config.h, cpu/call_geometry.h): gemm_allreduce takes one full-width tile row per
rank (tile_row_per_rank_geometry) from M >= 1024 and 2M >= K, else one tile row in `world` column panels
(column_panel_geometry); add+RMSNorm one full-width tile row per rank. Where M < 16K those calls multiply the rank's
whole partial in one GEMM call (CallJob::one_product), tile by tile otherwise. The rules; which
calls take them (the switch's three modes, and the dtypes whose products reorder B on this CPU); results against
float64 and bit for bit on every rank, forced on for every dtype so that CPUs without native bf16 test them too, on
shapes that are not multiples of any tile, world 2 and 3, both ways the owner reduces, one-shot and two-phase sizes;
back-to-back stress of one-product calls among tile-by-tile ones with a late rank, and its negative control; and
ranks that differ in the switch get an error, not a hang."""
import random
import time

import pytest
import torch

import torch_gemm_ar
from expect import error_of_a_fused_call_with
from inputs import (TOLERANCE, assert_matches, assert_matches_sum_of_partials, bias_vector, digest, reference, shard,
                    weight)
from hooked_build import hooked
from scoped_env import engine_switch, scoped_env
from stress_call import fused_call_is_right
from test_add_rmsnorm import norm_weight_of, residual_of, rms_norm64
from torch_gemm_ar import _C
from engine_observation_build import observe

ONE_CORE = dict(TORCH_GEMM_AR_COMPUTE_THREADS="1", TORCH_GEMM_AR_COMM_THREADS="0")
NEVER, NATIVE_HALF, EVERY_DTYPE = 0, 1, 2

# (M, K, N): short and long calls, one-shot and two-phase sizes, N under and over one 512-column tile; both
# gemm_allreduce geometries (row panels from M >= 1024 and 2M >= K).
CALLS = [(1, 33, 65), (7, 300, 777), (129, 20, 1000), (1031, 37, 613), (2100, 9, 1100), (1030, 2070, 130)]


def gemm_allreduce_geometry(m, k, n, world):
    return (observe.tile_row_per_rank_geometry if observe.prefers_row_panels(m, k) else observe.column_panel_geometry)(m, n, world)


def test_the_rules(one_core_env):
    # gemm_allreduce: all M rows (rounded up to the 64-row stripes), N in `world` panels of 16-column multiples.
    assert observe.column_panel_geometry(1031, 613, 2) == (1088, 320, 64)
    assert observe.column_panel_geometry(1, 2048, 2) == (64, 1024, 64)
    assert observe.column_panel_geometry(1543, 517, 3) == (1600, 176, 64)
    assert observe.column_panel_geometry(4096, 5000, 4) == (4096, 1264, 64)
    # add+RMSNorm: whole rows, M / world rows a tile (rounded up to the 16-row stripes).
    assert observe.tile_row_per_rank_geometry(1031, 613, 2) == (528, 624, 16)
    assert observe.tile_row_per_rank_geometry(1, 2048, 2) == (16, 2048, 16)
    assert observe.tile_row_per_rank_geometry(1543, 300, 3) == (528, 512, 16)
    # gemm_allreduce: row panels for long calls whose K is not over 2M (world - 1 more reorders of B against strided
    # half rows in every reduction and copy), column panels otherwise.
    assert observe.prefers_row_panels(1024, 2048) and observe.prefers_row_panels(4096, 256)
    assert not observe.prefers_row_panels(1023, 16) and not observe.prefers_row_panels(2048, 4097)
    # One GEMM call for the whole partial below M = 16K (B's reorders weigh more than the tiles' earlier publication).
    assert observe.prefers_one_product(2048, 1024) and observe.prefers_one_product(4095, 256)
    assert not observe.prefers_one_product(4096, 256) and not observe.prefers_one_product(16384, 1024)
    # Long-K gemm_allreduce calls take them in every dtype: K over 2M, from M = 512.
    assert observe.is_long_k_call(512, 1025) and observe.is_long_k_call(1024, 4096)
    assert not observe.is_long_k_call(511, 8192) and not observe.is_long_k_call(1024, 2048)
    # A comm thread overlaps the GEMM at the default tiles' finer grain; a tile from the environment is kept.
    one_core_env.setenv("TORCH_GEMM_AR_COMM_THREADS", "1")
    assert observe.column_panel_geometry(4096, 2048, 2) == (256, 512, 64)
    assert observe.tile_row_per_rank_geometry(4096, 2048, 2) == observe.row_epilogue_geometry(4096, 2048, 2)
    one_core_env.setenv("TORCH_GEMM_AR_COMM_THREADS", "0")
    one_core_env.setenv("TORCH_GEMM_AR_CPU_TILE", "128,256,32")
    assert observe.column_panel_geometry(4096, 2048, 2) == (128, 256, 32)
    assert observe.tile_row_per_rank_geometry(4096, 2048, 2) == (128, 256, 32)


def each_switch_mode():
    """(dtype, like, mode, takes) for every dtype and mode of the switch, with the switch set to that mode: `takes`
    says whether the rules give the dtype the fewer-product geometries (long-K gemm_allreduce calls aside). The
    caller restores the switch."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        like = torch.empty(0, dtype=dtype)
        native = observe.reorders_b_per_product(like)
        for mode, takes in ((NEVER, False), (NATIVE_HALF, native), (EVERY_DTYPE, True)):
            _C._set_engine_option("fewer_b_reorders", mode)
            yield dtype, like, mode, takes


def test_which_calls_take_them(one_core_env):
    previous = _C._set_engine_option("fewer_b_reorders", NATIVE_HALF)
    try:
        for dtype, like, mode, takes in each_switch_mode():
            for k, fewer in ((1024, observe.tile_row_per_rank_geometry), (8192, observe.column_panel_geometry),
                             (128, observe.tile_row_per_rank_geometry)):
                # A long K (over 2M) takes them in every dtype, gemm_allreduce only.
                long_k = mode == NATIVE_HALF and k == 8192
                want = fewer(2048, 1024, 2) if takes or long_k else observe.wide_row_geometry(2048, 1024, 2)
                assert observe.call_geometry("gemm_allreduce", 2048, k, 1024, like, 2) == want, (dtype, mode, k)
                want = (observe.tile_row_per_rank_geometry if takes else observe.row_epilogue_geometry)(2048, 1024, 2)
                assert observe.call_geometry("add_rmsnorm", 2048, k, 1024, like, 2) == want, (dtype, mode, k)
                one = observe.call_multiplies_in_one_product("gemm_allreduce", 2048, k, 1024, like, 2)
                assert one == ((takes or long_k) and k != 128), (dtype, mode, k)
                one = observe.call_multiplies_in_one_product("add_rmsnorm", 2048, k, 1024, like, 2)
                assert one == (takes and k != 128), (dtype, mode, k)
        # fp32 products never reorder B per call (oneMKL; the engine packs B's panels itself).
        assert not observe.reorders_b_per_product(torch.empty(0))
        with pytest.raises(ValueError, match=r"fewer_b_reorders. must be in \[0, 2\]"):
            _C._set_engine_option("fewer_b_reorders", 3)
        with pytest.raises(ValueError, match="op must be"):
            observe.call_geometry("matmul", 2, 2, 2, torch.empty(0), 2)
    finally:
        _C._set_engine_option("fewer_b_reorders", previous)


def fewer_b_reorder_calls(rank, world, seed, owner_last):
    digests = []
    eps = 1e-5
    with scoped_env(**ONE_CORE):
        # Decode-sized calls (the first two) would take the decode geometry (tests/test_decode.py).
        previous = (_C._set_engine_option("fewer_b_reorders", EVERY_DTYPE),
                    _C._set_engine_option("owner_last", owner_last), _C._set_engine_option("decode", False))
        try:
            for case, (m, k, n) in enumerate(CALLS):
                one_product = observe.prefers_one_product(m, k)
                for dtype in (torch.float32, torch.bfloat16, torch.float16):
                    step = seed + 17 * case
                    like = torch.empty(0, dtype=dtype)
                    tiles = observe.call_geometry("gemm_allreduce", m, k, n, like, world)
                    assert tiles == gemm_allreduce_geometry(m, k, n, world), (m, k, n, dtype, tiles)
                    shards = [shard(step, r, m, k, dtype, three_d=case % 2 == 0) for r in range(world)]
                    b = weight(step, k, n, dtype, transposed=case % 2 == 1)
                    bias = bias_vector(step, n, dtype) if case % 3 != 1 else None
                    what = f"M={m} K={k} N={n} {dtype} world {world} owner_last={owner_last}"
                    before = observe.one_product_calls()
                    out = torch_gemm_ar.gemm_allreduce(shards[rank], b, bias=bias, algorithm="fused")
                    # The owner-last walk and one shot (small fp32 calls) multiply in one product where the geometry
                    # asks for it; the comm blocks' way multiplies tile by tile.
                    took = observe.one_product_calls() - before
                    assert took == int(one_product and owner_last), (what, took)
                    ref_sum = reference(shards, b, bias)
                    assert out.shape == shards[rank].shape[:-1] + (n,), what
                    assert_matches_sum_of_partials(out, shards, b, bias, dtype, k, f"{what} gemm_allreduce, tiles {tiles}")
                    digests.append(digest(out))
                    if dtype == torch.float16:
                        continue  # add+RMSNorm: fp32 and bf16 (its CPU dtypes' tests are in test_add_rmsnorm.py)
                    tiles = observe.call_geometry("add_rmsnorm", m, k, n, like, world)
                    assert tiles == observe.tile_row_per_rank_geometry(m, n, world), (m, n, dtype, tiles)
                    label = f"{what} add+RMSNorm, tiles {tiles}"
                    residual = residual_of(step, ref_sum.shape, dtype)
                    w = norm_weight_of(step, n, dtype)
                    summed, normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm(shards[rank], b, residual, w, eps=eps,
                                                                              bias=bias, algorithm="fused")
                    in_place = residual.clone()
                    normed_ip = torch_gemm_ar.gemm_allreduce_add_rmsnorm_(shards[rank], b, in_place, w, eps=eps,
                                                                          bias=bias, algorithm="fused")
                    assert torch.equal(in_place, summed), label + ": the in-place residual differs from out"
                    assert torch.equal(normed_ip, normed), label + ": the in-place normed differs"
                    assert_matches(summed, ref_sum + residual.double(), dtype, k + 9, world, label + " out")
                    tol = TOLERANCE[dtype]
                    torch.testing.assert_close(normed.double(), rms_norm64(summed, w, eps), rtol=tol, atol=4 * tol,
                                               msg=lambda s: f"{label} normed: {s}")
                    digests.append(digest(summed) + digest(normed))
        finally:
            _C._set_engine_option("fewer_b_reorders", previous[0])
            _C._set_engine_option("owner_last", previous[1])
            _C._set_engine_option("decode", previous[2])
    return digests


@pytest.mark.parametrize("owner_last", [True, False], ids=["owner_last", "comm_block"])
@pytest.mark.parametrize("world", [2, 3])
def test_fewer_tile_rows_match_float64_and_ranks_agree(ranks, world, owner_last):
    per_rank = ranks(world).run(fewer_b_reorder_calls, random.randrange(1 << 30), owner_last)
    assert len(set(map(tuple, per_rank))) == 1, "ranks returned different results"


def empty_outputs(rank, world):
    with scoped_env(**ONE_CORE):
        previous = _C._set_engine_option("fewer_b_reorders", EVERY_DTYPE)
        try:
            for dtype in (torch.float32, torch.bfloat16):
                out = torch_gemm_ar.gemm_allreduce(torch.ones(5, 3, dtype=dtype), torch.ones(3, 0, dtype=dtype),
                                                   algorithm="fused")
                assert out.shape == (5, 0) and out.dtype == dtype, (out.shape, out.dtype)
                full = torch_gemm_ar.gemm_allreduce(torch.ones(5, 3, dtype=dtype), torch.ones(3, 4, dtype=dtype),
                                                    algorithm="fused")
                assert torch.equal(full, torch.full((5, 4), 3.0 * world, dtype=dtype)), full
        finally:
            _C._set_engine_option("fewer_b_reorders", previous)
    return True


def test_empty_outputs_keep_working(ranks, one_core_env):
    """N=0 (and the tile walk's M=0) make no tiles: the geometries must not turn them into an invalid plan."""
    assert ranks(2).run(empty_outputs) == [True, True]
    previous = _C._set_engine_option("fewer_b_reorders", EVERY_DTYPE)
    try:
        assert _C._engine_tile_walk(torch.ones(0, 3), torch.ones(3, 4), None, 2).shape == (0, 4)
        assert _C._engine_tile_walk(torch.ones(5, 3), torch.ones(3, 0), None, 2).shape == (5, 0)
    finally:
        _C._set_engine_option("fewer_b_reorders", previous)


def random_call(rng):
    """One product with row panels or column panels, or tile by tile (M >= 16K), in fp32 (forced) or bf16."""
    kind = rng.choice(["rows", "columns", "tiles"])
    if kind == "rows":
        m, k, n = rng.randint(1024, 1100), rng.randint(300, 700), rng.randint(1, 300)
    elif kind == "columns":
        m, k, n = rng.randint(1, 300), rng.randint(80, 200), rng.randint(1, 700)
    else:
        m, k, n = rng.randint(1024, 1100), rng.randint(1, 64), rng.randint(1, 300)
    return m, k, n, rng.choice([torch.float32, torch.bfloat16]), rng.random() < 0.3


def one_product_stress(rank, world, seed, calls, ignore_epochs=False, one_shot=False):
    """Back-to-back fused calls with new inputs and shapes; a rank runs late now and then. Returns the number of wrong
    results and of calls multiplied in one GEMM call. one_shot: small fp32 calls take the one-shot reduction, which
    multiplies into the bank in one product too."""
    rng = random.Random(seed)
    wrong = 0
    before = observe.one_product_calls()
    with engine_switch("fewer_b_reorders", EVERY_DTYPE, **ONE_CORE), engine_switch("one_shot", one_shot), \
            hooked("ignore_epochs", ignore_epochs):
        for step in range(calls):
            m, k, n, dtype, with_bias = random_call(rng)
            if rank == step % world and step % 5 == 0:
                time.sleep(0.002)
            wrong += not fused_call_is_right(rank, world, seed + step, m, k, n, dtype, with_bias, step % 2 == 0)
    return wrong, observe.one_product_calls() - before


@pytest.mark.parametrize("world,calls,one_shot", [(2, 1000, False), (3, 300, False), (2, 400, True), (3, 150, True)])
def test_one_product_back_to_back_stress(ranks, world, calls, one_shot):
    results = ranks(world).run(one_product_stress, random.randrange(1 << 30), calls, False, one_shot, timeout_s=600)
    assert [wrong for wrong, _ in results] == [0] * world, f"wrong results per rank: {results}"
    # Two thirds of the calls are one-product shapes.
    assert all(one > calls // 2 for _, one in results), results


@pytest.mark.parametrize("one_shot", [False, True])
def test_negative_control_stress_catches_stale_partials(hooked_ranks, one_shot):
    """With any earlier call's flag taken as this call's (a deliberate protocol bug), a rank reduces partials its
    peer has not written yet: the same stress test must report wrong results."""
    results = hooked_ranks(2).run(one_product_stress, random.randrange(1 << 30), 300, True, one_shot, timeout_s=600)
    assert sum(wrong for wrong, _ in results) > 0, f"the stress test did not notice stale partials: {results}"


def mixed_switch(rank, world):
    return error_of_a_fused_call_with("fewer_b_reorders", EVERY_DTYPE if rank == 0 else NEVER, ONE_CORE,
                                      (600, 8), (8, 1100))


def test_ranks_that_differ_in_the_switch_get_an_error_not_a_hang(ranks):
    for message in ranks(2).run(mixed_switch, timeout_s=120):
        assert "tile" in message.lower(), message
