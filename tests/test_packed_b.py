"""The CPU engine's tiles through B's panels packed once per call (cpu/packed_b_panels.h, oneMKL's packed GEMM found
at run time): calls of two tile rows or more take it (counted), results match float64 and are bitwise the same on
every rank, with a transposed weight, bias, 3-D inputs, odd shapes, fp32 and bf16, world 2 and 3, the owner-last
walk and the comm blocks; the same calls with the packed path switched off agree within rounding."""
import random

import pytest
import torch

import torch_gemm_ar
from engine_walks import engine_grid, walk_env
from inputs import assert_matches, bias_vector, digest, reference, shard, weight
from scoped_env import scoped_env
from torch_gemm_ar import _C
from engine_observation_build import observe

# (M, K, N, bias, transposed b, 3-D a): M over two tile rows (256), K x N over 16K elements (the engine packs no
# smaller B), none a multiple of the tiles.
SHAPES = [(600, 70, 777, True, True, False), (513, 17, 1030, False, False, False), (1000, 300, 65, True, False, True),
          (300, 129, 513, False, True, False)]


def packed_and_unpacked(rank, world, seed, dtype, owner_last):
    # One compute thread (the packed path's condition) and, for the owner-last walk, communication between tiles,
    # whatever the host's core count.
    with walk_env(owner_last):
        return packed_and_unpacked_here(rank, world, seed, dtype, owner_last)


def packed_and_unpacked_here(rank, world, seed, dtype, owner_last):
    previous = (_C._set_engine_option("packed_b", True), _C._set_engine_option("owner_last", owner_last))
    digests = []
    try:
        for case, (m, k, n, with_bias, transposed, three_d) in enumerate(SHAPES):
            shards = [shard(seed + case, r, m, k, dtype, three_d) for r in range(world)]
            b = weight(seed + case, k, n, dtype, transposed)
            bias = bias_vector(seed + case, n, dtype) if with_bias else None
            ref = reference(shards, b, bias)
            what = f"{dtype} M={m} K={k} N={n} bias={with_bias} bT={transposed} 3d={three_d} rank={rank}"
            before = observe.packed_b_panels()
            packed = torch_gemm_ar.gemm_allreduce(shards[rank], b, bias=bias, algorithm="fused")
            packed_panels = observe.packed_b_panels() - before
            _C._set_engine_option("packed_b", False)
            before = observe.packed_b_panels()
            plain = torch_gemm_ar.gemm_allreduce(shards[rank], b, bias=bias, algorithm="fused")
            assert observe.packed_b_panels() == before, what + ": switched off, panels were still packed"
            _C._set_engine_option("packed_b", True)
            # fp32 GEMMs (bf16 too where this CPU computes it in fp32) pack each of B's column panels once.
            if dtype == torch.float32 or _C._computes_in_fp32(torch.empty(0, dtype=dtype)):
                assert packed_panels == -(-n // 512), f"{what}: {packed_panels} panels packed"
            assert_matches(packed, ref, dtype, k, world, what + " packed")
            assert_matches(plain, ref, dtype, k, world, what + " at::mm")
            digests.append(digest(packed))
    finally:
        _C._set_engine_option("packed_b", previous[0])
        _C._set_engine_option("owner_last", previous[1])
    return digests


def packed_unless_capped(rank, world):
    """Panels packed under the default cap; TORCH_GEMM_AR_PACKED_B_MAX_MB=0: none fits, every tile goes through
    at::mm (and is still right). Also a transposed weight read through an expanded a (row stride 0): at::mm's."""
    shards = [shard(5, r, 600, 70, torch.float32) for r in range(world)]
    b = weight(5, 70, 777, torch.float32, True)
    expanded = [s[:1].expand(600, 70) for s in shards]
    counts = []
    with scoped_env(TORCH_GEMM_AR_COMPUTE_THREADS="1"):
        for cap, inputs in (("256", shards), ("0", shards), ("256", expanded)):
            with scoped_env(TORCH_GEMM_AR_PACKED_B_MAX_MB=cap):
                before = observe.packed_b_panels()
                out = torch_gemm_ar.gemm_allreduce(inputs[rank], b, algorithm="fused")
                counts.append(observe.packed_b_panels() - before)
            assert_matches(out, reference(inputs, b), torch.float32, 70, world, f"cap {cap}")
    return counts


@pytest.mark.skipif("not observe.packed_b_available()",
                    reason="torch's BLAS here has no packed GEMM (not a oneMKL build): the engine keeps at::mm")
def test_the_memory_cap_and_unsuitable_strides_keep_at_mm(ranks):
    # 2 panels of 512 columns for N=777; none under a zero cap; none for an expanded a (declined before packing).
    for counts in ranks(2).run(packed_unless_capped):
        assert counts == [2, 0, 0], counts


@pytest.mark.skipif("not observe.packed_b_available()",
                    reason="torch's BLAS here has no packed GEMM (not a oneMKL build): the engine keeps at::mm")
@engine_grid
def test_packed_panels_match_float64_on_every_rank(ranks, world, dtype, owner_last):
    per_rank = ranks(world).run(packed_and_unpacked, random.randrange(1 << 30), dtype, owner_last)
    assert len(set(map(tuple, per_rank))) == 1, "ranks returned different tensors"
