// The tiles of one CPU engine call: which geometry rule the call takes (engine_config.h has the rules), and B's
// packed panels where the tiles share them.
#pragma once
#include <ATen/ATen.h>
#include <gemm_ar/tile_plan.hpp>

#include <optional>

#include "common/algorithm.h"
#include "common/local_gemm.h"
#include "cpu/engine_config.h"
#include "cpu/packed_b_panels.h"

namespace gemm_ar::cpu {

// The engine's configuration for one call of `op` (OpKind) of [M, K] x [K, N] in `dtype` on `world` local ranks: the
// settings (engine_config) with the op's own tile geometry where the engine options allow it. Decode-sized calls
// (takes_decode_geometry) decode_geometry, whatever their dtype. Where the call's
// products reorder B per call (reorders_b_per_product): add+RMSNorm tile_row_per_rank_geometry, gemm_allreduce
// tile_row_per_rank_geometry where prefers_row_panels(M, K), else column_panel_geometry; the same for a long-K
// gemm_allreduce in any dtype (is_long_k_call); gemm_reduce_scatter and allgather_gemm tile_row_per_rank_geometry
// (tile by tile, one tile row per rank's chunk); otherwise add+RMSNorm row_epilogue_geometry, gemm_allreduce and
// gemm_reduce_scatter wide_row_geometry.
// `family` (CallArgs::fused_family): 0 as above; for gemm_allreduce, 1 forces the default tiles (wide_row_geometry)
// and 2 the geometries with few products (row or column panels), what `auto` measured faster on this CPU; 3 the
// gathered-inputs flow (cpu/gathered_inputs.h) on tile_row_per_rank_geometry's tiles.
// `chunk_rows`: for the sequence-parallel ops, the rows of one rank's chunk (row_chunks.hpp; M / world of a 2-D
// gemm_reduce_scatter, the shard's rows of a 2-D allgather_gemm).
EngineConfig call_config(int64_t op, int64_t m, int64_t k, int64_t n, at::ScalarType dtype, int world,
                         int64_t family = 0, int64_t chunk_rows = 0);

// Whether a call of `op` (OpKind) of M x N in `dtype` on `world` local ranks takes decode_geometry (engine_config.h)
// under the geometry rules: gemm_allreduce or add+RMSNorm, M <= kDecodeMaxRows, every rank reading its peers'
// whole partials within the one-shot bound (kOneShotMaxReadBytes), with the engine options that make it one shot
// (decode, one_shot, owner_last, overlap). decode_geometry itself adds the configuration's conditions (one core
// per rank, no tile from the environment).
bool takes_decode_geometry(int64_t op, int64_t m, int64_t n, at::ScalarType dtype, int world);

// For `auto`: the forced family (FusedTiles or FusedFewProducts) whose configuration differs from the rules' for this
// gemm_allreduce call, where the output is big enough for its tiles to matter (from 64K elements); Auto otherwise.
Algorithm other_tile_family(int64_t m, int64_t k, int64_t n, at::ScalarType dtype, int world);

// Of the two geometries with few products for a gemm_allreduce whose products reorder all of B per call: one full-width
// tile row per rank costs world - 1 more reorders of B (K x N each); column panels of all M rows cost strided half rows
// in the reduction and the copies, much slower than whole rows (M x N). Row panels win from M >= 1024 and 2M >= K
// (docs/journal/performance-journal.md).
bool prefers_row_panels(int64_t m, int64_t k);

// A gemm_allreduce of [M, K] x [K, N] whose K is over 2M (from M = 512): its tile rows each stream all of B's packed
// panels (K x N) from memory, so the default tiles cost more than one product, and with little output per unit of
// compute the communication gains nothing from them. Such calls take the fewer-product geometries in every dtype
// (docs/journal/performance-journal.md).
bool is_long_k_call(int64_t m, int64_t k);

// Whether those geometries multiply the rank's whole partial in one GEMM call (EngineConfig::one_product) rather than
// tile by tile: one call reorders B once, not once per tile, but every tile is then published only at the end. One
// call wins while M/K is small enough for B's reorders to matter; from M/K 16 B is cheap to reorder against the
// output's size and tile by tile wins (docs/journal/performance-journal.md).
bool prefers_one_product(int64_t m, int64_t k);

// Whether a call of `config` multiplies this rank's whole partial in one GEMM call where the owner reduces in the
// compute block (EngineConfig::one_product, under the engine options); the engine adds the call's own conditions
// (CallJob::one_product).
bool multiplies_in_one_product(const EngineConfig& config);

// Whether an allgather_gemm call of `config` multiplies all rows in one GEMM call where every peer's shard is in
// (EngineConfig::one_product on one compute block with the comm block inline, under the one_product switch).
bool gathers_in_one_product(const EngineConfig& config);

// B's panels packed once for every tile row of `plan` (cpu/packed_b_panels.h) where the engine packs them: `gemm`
// then multiplies through `panels`, which must outlive its calls.
void use_packed_panels(LocalGemm& gemm, const TilePlan& plan, int64_t compute_blocks,
                       std::optional<PackedBPanels>& panels);

}  // namespace gemm_ar::cpu
