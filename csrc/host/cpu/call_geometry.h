// The tiles of one CPU engine call: which geometry rule the call takes (engine_config.h has the rules), and B's
// packed panels where the tiles share them.
#pragma once
#include <ATen/ATen.h>
#include <gemm_ar/tile_plan.hpp>

#include <optional>

#include "common/local_gemm.h"
#include "cpu/engine_config.h"
#include "cpu/packed_b_panels.h"

namespace gemm_ar::cpu {

// The engine's configuration for one call of `op` (OpKind) of M x N in `dtype` on `world` local ranks: the settings
// (engine_config) with the op's own tile geometry where the engine switches allow it. Where the call's products
// reorder B per call (reorders_b_per_product): add+RMSNorm tile_row_per_rank_geometry, gemm_allreduce
// column_panel_geometry; otherwise add+RMSNorm row_epilogue_geometry, gemm_allreduce and gemm_reduce_scatter
// wide_row_geometry.
EngineConfig call_config(int64_t op, int64_t m, int64_t n, at::ScalarType dtype, int world);

// B's panels packed once for every tile row of `plan` (cpu/packed_b_panels.h) where the engine packs them: `gemm`
// then multiplies through `panels`, which must outlive its calls.
void use_packed_panels(LocalGemm& gemm, const TilePlan& plan, int64_t compute_blocks,
                       std::optional<PackedBPanels>& panels);

}  // namespace gemm_ar::cpu
