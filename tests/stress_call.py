"""One call of a back-to-back stress test: a fused gemm_allreduce on fresh inputs, checked against float64."""
import torch_gemm_ar
from inputs import assert_matches_sum_of_partials, bias_vector, shard, weight


def fused_call_is_right(rank, world, seed, m, k, n, dtype, with_bias, transposed=False) -> bool:
    """Call `seed`'s inputs (every rank builds every rank's shard alike); False when this rank's result misses the
    float64 sum (stress tests count such calls rather than stop at the first)."""
    shards = [shard(seed, r, m, k, dtype) for r in range(world)]
    b = weight(seed, k, n, dtype, transposed=transposed)
    bias = bias_vector(seed, n, dtype) if with_bias else None
    out = torch_gemm_ar.gemm_allreduce(shards[rank], b, bias=bias, algorithm="fused")
    try:
        assert_matches_sum_of_partials(out, shards, b, bias, dtype, k, "stress")
    except AssertionError:
        return False
    return True
