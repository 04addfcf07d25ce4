"""Full-width tiles for gemm_allreduce and gemm_reduce_scatter on one-core ranks (cpu/engine_config.h,
wide_row_geometry): with communication between tiles, long calls take tiles as wide as the output (up to 2048
columns, N split into equal panels beyond), so every tile row packs its rows of A once. The rule, then both
geometries on shapes long enough to take it and not multiples of any tile: results match float64, gemm_allreduce's
ranks agree bitwise, and each call packs as many B panels as its geometry has (the wide one is really taken); the
owner-last walk and the comm block's way; fp32 and bf16; world 2 and 3."""
import random

import pytest
import torch

import torch_gemm_ar
from inputs import assert_matches, bias_vector, digest, reference, shard, weight
from scoped_env import scoped_env
from test_sequence_parallel_fused import reduce_scatter_case
from torch_gemm_ar import _C
from engine_observation_build import observe

# (op, M, K, N): M >= 2 x world x 256 rows, K x N over 16K elements (B's panels are packed), N over 512.
LONG_CALLS = {
    2: [("ar", 1031, 37, 613), ("ar", 1100, 20, 2100), ("rs", 1032, 45, 700)],
    3: [("ar", 1543, 33, 517), ("rs", 1539, 40, 600)],
}

ONE_CORE = dict(TORCH_GEMM_AR_COMPUTE_THREADS="1", TORCH_GEMM_AR_COMM_THREADS="0")


def tile_cols(m, n, world):
    return observe.wide_row_geometry(m, n, world)[1]


def test_the_rule(one_core_env):
    assert observe.wide_row_geometry(1031, 613, 2) == (256, 624, 64)  # one panel, rounded up to 16 columns
    assert observe.wide_row_geometry(1100, 2100, 2) == (256, 1056, 64)  # over 2048: two equal panels
    assert observe.wide_row_geometry(4096, 5000, 2) == (256, 1680, 64)  # three
    assert observe.wide_row_geometry(1543, 517, 3) == (256, 528, 64)
    # Too short for every rank to own two tile rows, or already one tile wide: the default tiles.
    assert observe.wide_row_geometry(1023, 613, 2) == (256, 512, 64)
    assert observe.wide_row_geometry(1535, 613, 3) == (256, 512, 64)
    assert observe.wide_row_geometry(4096, 512, 2) == (256, 512, 64)
    # A comm thread overlaps the GEMM at the default tiles' finer grain.
    one_core_env.setenv("TORCH_GEMM_AR_COMM_THREADS", "1")
    assert observe.wide_row_geometry(4096, 2048, 2) == (256, 512, 64)
    # A tile from the environment is kept for every call.
    one_core_env.setenv("TORCH_GEMM_AR_COMM_THREADS", "0")
    one_core_env.setenv("TORCH_GEMM_AR_CPU_TILE", "128,256,32")
    assert observe.wide_row_geometry(4096, 2048, 2) == (128, 256, 32)


def one_call(rank, world, seed, op, m, k, n, dtype):
    """(output, float64 reference) of one fused call of `op` on fresh inputs."""
    if op == "rs":
        return reduce_scatter_case(rank, world, seed, dtype, lambda _k: (m, k), 0, k, n, True)
    shards = [shard(seed, r, m, k, dtype, three_d=n > 2048) for r in range(world)]
    b = weight(seed, k, n, dtype, transposed=n < 1000)
    bias = bias_vector(seed, n, dtype)
    return torch_gemm_ar.gemm_allreduce(shards[rank], b, bias=bias, algorithm="fused"), reference(shards, b, bias)


def both_geometries(rank, world, seed, dtype, owner_last):
    packs_in_fp32 = observe.packed_b_available() and (
        dtype == torch.float32 or _C._computes_in_fp32(torch.empty(0, dtype=dtype)))
    digests = []
    with scoped_env(**ONE_CORE):
        # Column panels (test_fewer_b_reorders.py) would replace both geometries for natively computed bf16.
        previous = (_C._set_engine_option("owner_last", owner_last), _C._set_engine_option("wide_row_panels", True),
                    _C._set_engine_option("fewer_b_reorders", 0))
        try:
            for case, (op, m, k, n) in enumerate(LONG_CALLS[world]):
                cols = tile_cols(m, n, world)
                what = f"{op} {dtype} M={m} K={k} N={n} world={world} owner_last={owner_last} rank={rank}"
                assert cols > 512, what + f": the wide geometry does not apply ({cols} columns)"
                for wide in (True, False):
                    _C._set_engine_option("wide_row_panels", wide)
                    before = observe.packed_b_panels()
                    out, want = one_call(rank, world, seed + case, op, m, k, n, dtype)
                    panels = observe.packed_b_panels() - before
                    label = f"{what} {'wide' if wide else 'default'} tiles"
                    assert_matches(out, want, dtype, k, world, label)
                    if packs_in_fp32:  # one packed panel of B per tile column
                        assert panels == -(-n // (cols if wide else 512)), f"{label}: {panels} panels packed"
                    if op == "ar":
                        digests.append(digest(out))
        finally:
            _C._set_engine_option("owner_last", previous[0])
            _C._set_engine_option("wide_row_panels", previous[1])
            _C._set_engine_option("fewer_b_reorders", previous[2])
    return digests


@pytest.mark.parametrize("owner_last", [True, False], ids=["owner_last", "comm_block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("world", [2, 3])
def test_both_geometries_match_float64_and_ranks_agree(ranks, world, dtype, owner_last):
    per_rank = ranks(world).run(both_geometries, random.randrange(1 << 30), dtype, owner_last)
    assert len(set(map(tuple, per_rank))) == 1, "ranks returned different gemm_allreduce results"
