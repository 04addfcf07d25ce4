"""The CPU engine's GEMM alone (cpu/engine_tile_walk.h, `_C._engine_tile_walk`), which the benchmarks' "engine GEMM
only" row times: a @ b (+ bias) multiplied in the tiles a gemm_allreduce call of that shape would take (wide or
default, through packed B panels or at::mm) matches float64, on shapes that are not multiples of any tile, fp32 and
bf16; bad arguments raise naming them."""
import pytest
import torch

from inputs import TOLERANCE, bias_vector, reference, shard, weight
from scoped_env import scoped_env
from torch_gemm_ar import _C
from engine_observation_build import observe

ONE_CORE = dict(TORCH_GEMM_AR_COMPUTE_THREADS="1", TORCH_GEMM_AR_COMM_THREADS="0")
TWO_BLOCKS = dict(TORCH_GEMM_AR_COMPUTE_THREADS="2", TORCH_GEMM_AR_COMM_THREADS="1")  # the engine packs no panels


def expected_panels(ranks, m, n, dtype, wide, packed):
    """B panels the engine packs for a gemm_allreduce of this shape: one per tile column, on one-core ranks only,
    from two tile rows on, when the packed GEMM computes this dtype in fp32."""
    packs = observe.packed_b_available() and (dtype == torch.float32 or _C._computes_in_fp32(torch.empty(0, dtype=dtype)))
    rows, cols = observe.wide_row_geometry(m, n, 2)[:2] if wide else (256, 512)
    if ranks is not ONE_CORE or not packed or not packs or m <= rows:
        return 0
    return -(-n // cols)


@pytest.mark.parametrize("ranks", [ONE_CORE, TWO_BLOCKS], ids=["one_core", "two_compute_blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,k,n,transposed", [(1031, 37, 613, True), (300, 129, 777, False), (7, 33, 65, False)])
def test_tile_walk_matches_float64(m, k, n, transposed, dtype, ranks):
    a = shard(3, 0, m, k, dtype)
    b = weight(3, k, n, dtype, transposed)
    bias = bias_vector(3, n, dtype)
    want = reference([a], b, bias)
    tol = TOLERANCE[dtype]
    with scoped_env(**ranks):
        previous = (_C._set_engine_option("wide_row_panels", True), _C._set_engine_option("packed_b", True))
        try:
            for wide in (True, False):
                for packed in (True, False):
                    _C._set_engine_option("wide_row_panels", wide)
                    _C._set_engine_option("packed_b", packed)
                    before = observe.packed_b_panels()
                    out = _C._engine_tile_walk(a, b, bias, 2)
                    what = f"wide={wide} packed={packed}"
                    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * (k ** 0.5 + 1),
                                               msg=lambda s: f"{what}: {s}")
                    # The geometry and the panels the walk took are the engine's.
                    wide_applies = ranks is ONE_CORE and wide and observe.wide_row_geometry(m, n, 2)[1] > 512
                    assert observe.packed_b_panels() - before == expected_panels(ranks, m, n, dtype, wide_applies,
                                                                             packed), what
        finally:
            _C._set_engine_option("wide_row_panels", previous[0])
            _C._set_engine_option("packed_b", previous[1])


def test_bad_arguments_raise_naming_them():
    with pytest.raises(ValueError, match="a \\[M, K\\] and b \\[K, N\\]"):
        _C._engine_tile_walk(torch.ones(4, 5), torch.ones(6, 7))
    with pytest.raises(ValueError, match="world must be >= 1"):
        _C._engine_tile_walk(torch.ones(4, 5), torch.ones(5, 7), None, 0)
