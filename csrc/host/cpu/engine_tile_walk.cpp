#include "cpu/engine_tile_walk.h"

#include <ATen/Parallel.h>
#include <gemm_ar/protocol.hpp>
#include <gemm_ar/tile_plan.hpp>

#include "common/call_args.h"
#include "common/local_gemm.h"
#include "cpu/call_geometry.h"
#include "cpu/fused_engine.h"
#include "cpu/packed_b_panels.h"

namespace gemm_ar::cpu {

at::Tensor engine_tile_walk(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                            int world) {
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0) && a.device().is_cpu() &&
                        b.device().is_cpu() && a.scalar_type() == b.scalar_type(),
                    "engine_tile_walk: a [M, K] and b [K, N] of one dtype on the CPU; got ", a.sizes(), " ",
                    a.scalar_type(), " and ", b.sizes(), " ", b.scalar_type());
  TORCH_CHECK_VALUE(world >= 1, "engine_tile_walk: world must be >= 1; got ", world);
  const int64_t m = a.size(0), n = b.size(1), k = a.size(1);
  const EngineConfig config = call_config(kOpGemmAllreduce, m, k, n, a.scalar_type(), world);
  TilePlan plan{};
  TORCH_CHECK(make_tile_plan(&plan, m, n, k, config.base_m, config.base_n, 1, 1, config.sub_m),
              "engine_tile_walk: invalid tile plan for M=", m, " N=", n, " K=", k);
  LocalGemm gemm(a, b, bias, /*add_bias=*/true);
  at::Tensor out = at::empty({m, n}, a.options().dtype(gemm.compute_dtype()));
  if (multiplies_in_one_product(config)) {  // as the engine does (CallJob::one_product)
    if (m > 0 && n > 0) gemm.compute(0, m, 0, n, out);
    return out;
  }
  std::optional<PackedBPanels> panels;
  use_packed_panels(gemm, plan, config.compute_blocks, panels);
  // The compute blocks as the engine runs them (run_compute_blocks): each its range of the zigzag walk, in parallel
  // when the rank has the cores.
  at::parallel_for(0, config.compute_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const Range range = block_range(plan.tiles, config.compute_blocks, block);
      for (int64_t linear = range.begin; linear < range.end; ++linear) {
        const int64_t t = zigzag_tile(linear, plan.n_tiles);
        const int64_t mi = tile_row(plan, t), ni = tile_col(plan, t);
        const int64_t row0 = mi * plan.base_m, col0 = ni * plan.base_n;
        const int64_t rows = std::min(plan.base_m, m - row0), cols = tile_cols(plan, ni);
        gemm.compute(row0, rows, col0, cols, out.narrow(0, row0, rows).narrow(1, col0, cols));
      }
    }
  });
  return out;
}

}  // namespace gemm_ar::cpu
