#include "cpu/call_geometry.h"

#include <algorithm>

#include "common/call_args.h"
#include "cpu/fused_call.h"

namespace gemm_ar::cpu {

bool prefers_row_panels(int64_t m, int64_t k) { return m >= 1024 && 2 * m >= k; }

bool prefers_one_product(int64_t m, int64_t k) { return m < 16 * k; }

bool is_long_k_call(int64_t m, int64_t k) { return m >= 512 && k > 2 * m; }

namespace {

// Whether the geometry rules give this call the few-product family (the engine options included).
bool rules_take_few_products(int64_t op, int64_t m, int64_t k, at::ScalarType dtype) {
  const int64_t fewer = option(engine_options().fewer_b_reorders);
  return fewer == 2 ||
         (fewer == 1 && (reorders_b_per_product(dtype) || (op == kOpGemmAllreduce && is_long_k_call(m, k))));
}

bool same_geometry(const EngineConfig& a, const EngineConfig& b) {
  return a.base_m == b.base_m && a.base_n == b.base_n && a.sub_m == b.sub_m && a.one_product == b.one_product &&
         a.comm_inline == b.comm_inline && a.compute_blocks == b.compute_blocks && a.comm_blocks == b.comm_blocks;
}

}  // namespace

bool takes_decode_geometry(int64_t op, int64_t m, int64_t n, at::ScalarType dtype, int world) {
  const EngineOptions& o = engine_options();
  if (op != kOpGemmAllreduce && op != kOpGemmAllreduceAddRmsnorm) return false;
  if (!option(o.decode) || !option(o.one_shot) || !option(o.owner_last) || !option(o.overlap)) return false;
  if (world < 2 || m <= 0 || n <= 0 || m > kDecodeMaxRows) return false;
  // Decode calls multiply in the call's dtype (LocalGemm's `native`): their partials have its element size.
  return m * n * static_cast<int64_t>(c10::elementSize(dtype)) * (world - 1) <= kOneShotMaxReadBytes;
}

Algorithm other_tile_family(int64_t m, int64_t k, int64_t n, at::ScalarType dtype, int world) {
  if (m * n < 65536) return Algorithm::Auto;  // tiny calls: their tuning would cost more than tiles can change
  const Algorithm other =
      rules_take_few_products(kOpGemmAllreduce, m, k, dtype) ? Algorithm::FusedTiles : Algorithm::FusedFewProducts;
  const EngineConfig rules = call_config(kOpGemmAllreduce, m, k, n, dtype, world);
  const EngineConfig forced = call_config(kOpGemmAllreduce, m, k, n, dtype, world, fused_family_of(other));
  return same_geometry(rules, forced) ? Algorithm::Auto : other;
}

EngineConfig call_config(int64_t op, int64_t m, int64_t k, int64_t n, at::ScalarType dtype, int world, int64_t family,
                         int64_t chunk_rows) {
  const EngineConfig config = engine_config(world);
  if (op == kOpGemmAllreduce && family == 3) {
    // The gathered-inputs flow: one full-width tile row per rank, its rows multiplied in one product.
    EngineConfig gathered = tile_row_per_rank_geometry(config, m, n, world);
    gathered.one_product = false;
    gathered.gathered_inputs = gathered.comm_inline && !gathered.tile_from_env && m > 0 && n > 0;
    return gathered;
  }
  if (family == 0 && takes_decode_geometry(op, m, n, dtype, world)) return decode_geometry(config, m, n);
  const bool forced = op == kOpGemmAllreduce && family != 0;
  const bool fewer_b_reorders = forced ? family == 2 : rules_take_few_products(op, m, k, dtype);
  auto with_product_rule = [&](EngineConfig fewer) {
    fewer.one_product = fewer.one_product && prefers_one_product(m, k);
    return fewer;
  };
  if (op == kOpGemmAllreduceAddRmsnorm && option(engine_options().row_epilogue_geometry)) {
    return fewer_b_reorders ? with_product_rule(tile_row_per_rank_geometry(config, m, n, world))
                            : row_epilogue_geometry(config, m, n, world);
  }
  // Where column_panel_geometry keeps `config` (a tile from the environment, comm threads, an empty output),
  // wide_row_geometry keeps it too.
  if (op == kOpGemmAllreduce && fewer_b_reorders) {
    return with_product_rule(prefers_row_panels(m, k) ? tile_row_per_rank_geometry(config, m, n, world)
                                                      : column_panel_geometry(config, m, n, world));
  }
  if ((op == kOpGemmReduceScatter || op == kOpAllgatherGemm) && fewer_b_reorders) {
    // One tile row per rank's chunk: a product per chunk instead of one per 256-row tile, each reordering all of
    // B (docs/journal/performance-journal.md). allgather_gemm multiplies all rows in one product where every rank's
    // are in (CallJob::one_product); gemm_reduce_scatter's window keeps a padded tile row per chunk.
    EngineConfig per_rank = tile_row_per_rank_geometry(config, std::max<int64_t>(chunk_rows, 1) * world, n, world);
    per_rank.one_product = per_rank.one_product && op == kOpAllgatherGemm;  // not where the geometry kept `config`
    return per_rank;
  }
  if ((op == kOpGemmAllreduce || op == kOpGemmReduceScatter) && option(engine_options().wide_row_panels)) {
    return wide_row_geometry(config, m, n, world);
  }
  return config;
}

bool gathers_in_one_product(const EngineConfig& config) {
  return config.one_product && config.comm_inline && config.compute_blocks == 1 && option(engine_options().one_product);
}

bool multiplies_in_one_product(const EngineConfig& config) {
  // The same, in the owner-last walk (where the owner reduces in the compute block).
  return gathers_in_one_product(config) && option(engine_options().owner_last);
}

void use_packed_panels(LocalGemm& gemm, const TilePlan& plan, int64_t compute_blocks,
                       std::optional<PackedBPanels>& panels) {
  // Worth it from two tile rows on. One compute thread only: the packed GEMM threads as oneMKL is told, not as
  // ATen's parallel regions are.
  if (!option(engine_options().packed_b) || compute_blocks != 1 || plan.m_tiles < 2) return;
  panels.emplace(gemm.b(), plan.base_n, plan.base_m);
  if (panels->usable()) gemm.use_panels(&*panels);
}

}  // namespace gemm_ar::cpu
