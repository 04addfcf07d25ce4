// Tile sizes and thread counts of the CPU fused engine, from the machine and the environment (docs/usage.md,
// "Configuration"). They are part of the call signature, so ranks configured differently get a clear error.
#pragma once
#include <cstdint>

namespace gemm_ar::cpu {

struct EngineConfig {
  int64_t base_m, base_n, sub_m;  // TORCH_GEMM_AR_CPU_TILE="rows,cols,subtile_rows" (default 256,512,64)
  int64_t compute_blocks;         // TORCH_GEMM_AR_COMPUTE_THREADS (default: this rank's share of the cores)
  int64_t comm_blocks;            // comm blocks of the protocol
  // TORCH_GEMM_AR_COMM_THREADS: 0 runs the single comm block on the caller's thread between tiles (the default
  // when this rank's share of the cores is one: a comm thread could only take turns with the GEMM there);
  // N >= 1 runs N comm blocks on N threads (default 1 elsewhere).
  bool comm_inline;
  bool tile_from_env = false;  // TORCH_GEMM_AR_CPU_TILE was set: every call keeps that geometry
  // Set by the geometries for products that reorder all of B per call (tile_row_per_rank_geometry,
  // column_panel_geometry; call_config keeps it where prefers_one_product): where the owner reduces in the compute
  // block, the rank's whole partial comes from one GEMM call (CallJob::one_product), so B is reordered once per
  // call, not once per tile.
  bool one_product = false;
  // Set by call_config for the gathered-inputs flow (tile_row_per_rank_geometry's tiles; cpu/gathered_inputs.h).
  bool gathered_inputs = false;
  // Set by decode_geometry: one tile of the whole output, multiplied in one GEMM call and reduced in one shot
  // whatever the partials' dtype (cpu/call_plan.h).
  bool decode = false;
};

EngineConfig engine_config(int local_ranks);

// Whether TORCH_GEMM_AR_CPU_TILE is set (EngineConfig::tile_from_env): every geometry rule and forced family then
// keeps that tile, so ranks must agree on it (it is in the engine-mode field of the call signature).
bool tile_from_environment();

// The geometry of one add+RMSNorm call (a row epilogue): full-width tiles with short stripes, so that a stripe's
// rows are whole when the owner reduces them (or a peer copies them) and the epilogue normalises them while they
// are still in cache; no later pass over the output. Kept as `config` when the tile is from the environment, or
// when M is too short for every rank to own tiles of that height (full-width tiles would leave some rank without
// a share of the reduction). The same inputs on every rank give the same geometry (it is in the call signature).
EngineConfig row_epilogue_geometry(const EngineConfig& config, int64_t m, int64_t n, int world);

// The geometry of one gemm_allreduce or gemm_reduce_scatter call when communication runs between tiles on a one-core
// rank (comm_inline): tiles as wide as the output, up to 2048 columns (N split into equal panels beyond). Every tile
// packs its rows of A once per panel of B it multiplies, so wider tiles pack A fewer times and come closer to one
// whole GEMM (docs/journal/performance-journal.md). The pipeline's finer grain buys nothing there, as no comm thread
// overlaps the GEMM. Kept as `config` under the same conditions as row_epilogue_geometry, and with comm threads. The
// same inputs on every rank give the same geometry (it is in the call signature).
EngineConfig wide_row_geometry(const EngineConfig& config, int64_t m, int64_t n, int world);

// The geometry of one gemm_allreduce call on a one-core rank (comm_inline) whose tile products reorder all of B per
// call (reorders_b_per_product: bf16/fp16 through oneDNN): one tile row of all M rows, N split into `world` column
// panels (16-column aligned), so B is reordered once per call in all, not once per tile row, and every rank owns a
// panel to reduce (a narrow N may leave some rank none). Short calls too: each product costs a fixed overhead there,
// and `world` panels are fewer products than the default 512-column tiles of a wide output. Kept as `config` when
// the tile is from the environment, with comm threads, or for an empty output. The same inputs on every rank give
// the same geometry (it is in the call signature).
EngineConfig column_panel_geometry(const EngineConfig& config, int64_t m, int64_t n, int world);

// The geometry of one add+RMSNorm call (and of a long gemm_allreduce, call_geometry.h) on a one-core rank whose
// products reorder all of B per call: the row
// epilogue's full-width tiles and 16-row stripes, but one tile row per rank (M / world rows, rounded up to the
// stripes), so B is reordered `world` times per call instead of once per 256 rows, and at small M every rank still
// owns rows to reduce, where a single tile would leave the whole reduction to rank 0
// (docs/journal/performance-journal.md). Kept as row_epilogue_geometry when the tile is from the environment, with
// comm threads, or for an empty output.
EngineConfig tile_row_per_rank_geometry(const EngineConfig& config, int64_t m, int64_t n, int world);

// The most rows of a decode call (decode_geometry).
constexpr int64_t kDecodeMaxRows = 64;

// The geometry of one decode-sized gemm_allreduce call (M <= kDecodeMaxRows, every rank reducing in one shot) on a
// one-core rank (comm_inline): one tile of all M rows and all N columns, one stripe, its rows exactly N apart, so the
// rank's partial is one GEMM call into a contiguous [M, N] output, as `a @ b` is (no per-tile products, no column
// panels: at these sizes each product's fixed cost and each pass over B are what the call costs;
// docs/journal/performance-journal.md). Kept as `config` when the tile is from the environment, with comm threads,
// for an empty output or more rows. The same inputs on every rank give the same geometry (it is in the call
// signature).
EngineConfig decode_geometry(const EngineConfig& config, int64_t m, int64_t n);

}  // namespace gemm_ar::cpu
