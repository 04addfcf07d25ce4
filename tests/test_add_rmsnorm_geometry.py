"""The add+RMSNorm calls' own tile geometry on the CPU engine (cpu/engine_config.h, row_epilogue_geometry): long
calls get full-width tiles with 16-row stripes, so the epilogue normalises a stripe right after its reduction or
copy-out. Shapes long enough to take it (M >= 2 x world x 256 rows) and not multiples of any tile: both geometries'
out-of-place and in-place results match float64 (not bitwise each other: the GEMM library may round differently for
another output stride), the in-place residual is bitwise the out-of-place `out`, and ranks agree bitwise; with the
owner-last walk (forced: one compute thread, communication between tiles) and through the comm blocks; fp32 and
bf16; world 2 and 3."""
import random

import torch

import torch_gemm_ar
from engine_walks import engine_grid, walk_env
from inputs import TOLERANCE, assert_matches, bias_vector, digest, reference, shard, weight
from test_add_rmsnorm import norm_weight_of, residual_of, rms_norm64
from torch_gemm_ar import _C
from engine_observation_build import observe

# (M, K, N): M over 2 x world x 256 so the full-width geometry applies; N over the default tile width (512), odd.
LONG_SHAPES = {2: [(1031, 37, 613), (1100, 20, 1031)], 3: [(1543, 29, 517)]}


def both_geometries_checked(rank, world, seed, dtype, owner_last):
    with walk_env(owner_last):
        return both_geometries_here(rank, world, seed, dtype, owner_last)


def both_geometries_here(rank, world, seed, dtype, owner_last):
    # One tile row per rank (test_fewer_b_reorders.py) would replace the full-width geometry for natively computed bf16.
    previous = (_C._set_engine_option("owner_last", owner_last), _C._set_engine_option("row_epilogue_geometry", True),
                _C._set_engine_option("fewer_b_reorders", 0))
    eps = 1e-5
    digests = []
    try:
        for case, (m, k, n) in enumerate(LONG_SHAPES[world]):
            shards = [shard(seed + case, r, m, k, dtype, three_d=case == 1) for r in range(world)]
            b = weight(seed + case, k, n, dtype, transposed=case == 0)
            bias = bias_vector(seed + case, n, dtype) if case == 0 else None
            ref_sum = reference(shards, b, bias)
            residual = residual_of(seed + case, ref_sum.shape, dtype)
            w = norm_weight_of(seed + case, n, dtype)
            what = f"{dtype} M={m} K={k} N={n} world={world} owner_last={owner_last} rank={rank}"
            assert observe.row_epilogue_geometry(m, n, world)[1] >= n, what + ": the full-width geometry does not apply"
            results = {}
            for wide in (True, False):
                _C._set_engine_option("row_epilogue_geometry", wide)
                out, normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm(shards[rank], b, residual, w, eps=eps,
                                                                       bias=bias, algorithm="fused")
                in_place = residual.clone()
                normed_ip = torch_gemm_ar.gemm_allreduce_add_rmsnorm_(shards[rank], b, in_place, w, eps=eps,
                                                                      bias=bias, algorithm="fused")
                results[wide] = (out, normed, in_place, normed_ip)
            tol = TOLERANCE[dtype]
            for wide, (out, normed, in_place, normed_ip) in results.items():
                label = f"{what} {'full-width' if wide else 'default'} tiles"
                assert torch.equal(in_place, out), label + ": the in-place residual differs from out"
                assert torch.equal(normed_ip, normed), label + ": the in-place normed differs"
                assert_matches(out, ref_sum + residual.double(), dtype, k + 9, world, label + " out")
                torch.testing.assert_close(normed.double(), rms_norm64(out, w, eps), rtol=tol, atol=4 * tol,
                                           msg=lambda s: f"{label} normed: {s}")
            out, normed = results[True][:2]
            digests.append(digest(out) + digest(normed))
    finally:
        _C._set_engine_option("owner_last", previous[0])
        _C._set_engine_option("row_epilogue_geometry", previous[1])
        _C._set_engine_option("fewer_b_reorders", previous[2])
    return digests


def test_long_calls_take_full_width_tiles_and_short_ones_keep_the_default(monkeypatch):
    monkeypatch.delenv("TORCH_GEMM_AR_CPU_TILE", raising=False)
    for world, shapes in LONG_SHAPES.items():
        for m, _, n in shapes:
            assert observe.row_epilogue_geometry(m, n, world) == (256, (n + 15) // 16 * 16, 16), (m, n, world)
    # Too short for every rank to own two tile rows: the default tiles, which split N between owners.
    assert observe.row_epilogue_geometry(1023, 613, 2) == (256, 512, 64)
    # Narrow outputs already have whole rows per tile: only the stripes shorten.
    assert observe.row_epilogue_geometry(64, 300, 2) == (256, 512, 16)
    # A tile from the environment is kept for every call.
    monkeypatch.setenv("TORCH_GEMM_AR_CPU_TILE", "128,256,32")
    assert observe.row_epilogue_geometry(4096, 2048, 2) == (128, 256, 32)


@engine_grid
def test_both_geometries_match_float64_and_ranks_agree(ranks, world, dtype, owner_last):
    per_rank = ranks(world).run(both_geometries_checked, random.randrange(1 << 30), dtype, owner_last)
    assert len(set(map(tuple, per_rank))) == 1, "ranks returned different tensors"
