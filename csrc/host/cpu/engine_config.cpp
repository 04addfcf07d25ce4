#include "cpu/engine_config.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "common/settings.h"

namespace gemm_ar::cpu {

bool tile_from_environment() {
  const char* tile = env_text(Setting::kCpuTile);
  return tile != nullptr && *tile != '\0';
}

EngineConfig engine_config(int local_ranks) {
  EngineConfig config{256, 512, 64, 1, 1, false};
  if (const char* tile = env_text(Setting::kCpuTile); tile != nullptr && *tile != '\0') {
    long long m = 0, n = 0, s = 0;
    char tail = 0;
    const int fields = std::sscanf(tile, "%lld,%lld,%lld%c", &m, &n, &s, &tail);
    TORCH_CHECK(fields == 3 && m > 0 && n > 0 && s > 0 && m % s == 0 && m <= 65536 && n <= 65536,
                "environment variable TORCH_GEMM_AR_CPU_TILE='", tile,
                "' must be 'rows,cols,subtile_rows' with subtile_rows dividing rows (e.g. 256,512,64)");
    config.base_m = m;
    config.base_n = n;
    config.sub_m = s;
    config.tile_from_env = true;
  }
  // This rank's share of the cores, within the intra-op threads the user allowed (torchrun sets 1 per rank).
  // Read once: hardware_concurrency reads /sys on every call, and every call's configuration starts here.
  static const int64_t cores = std::max<unsigned>(1, std::thread::hardware_concurrency());
  const int64_t share = std::max<int64_t>(1, cores / std::max(1, local_ranks));
  const int64_t default_compute = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), share));
  config.compute_blocks = env_int(Setting::kComputeThreads, default_compute, 1, 1024);
  const int64_t comm_threads = env_int(Setting::kCommThreads, share <= 1 ? 0 : 1, 0, 64);
  config.comm_inline = comm_threads == 0;
  config.comm_blocks = std::max<int64_t>(1, comm_threads);
  TORCH_CHECK(!config.comm_inline || config.compute_blocks == 1,
              "TORCH_GEMM_AR_COMM_THREADS=0 (communication between tiles) needs one compute thread; got "
              "TORCH_GEMM_AR_COMPUTE_THREADS=",
              config.compute_blocks);
  return config;
}

namespace {

constexpr int64_t kColumnAlign = 16;

// The row epilogue's stripe: 16 rows of a 2048-column fp32 output are 128 KiB, so a stripe, its partials and its bank
// stay in L2 between the reduction and the normalisation.
constexpr int64_t kStripeRows = 16;

int64_t round_up_cols(int64_t cols) { return (cols + kColumnAlign - 1) / kColumnAlign * kColumnAlign; }

// Full-width tiles leave every rank a share of the reduction only when each owns two tile rows at least.
bool rows_for_every_owner(const EngineConfig& config, int64_t m, int world) {
  return m >= 2 * static_cast<int64_t>(world) * config.base_m;
}

}  // namespace

EngineConfig row_epilogue_geometry(const EngineConfig& config, int64_t m, int64_t n, int world) {
  if (config.tile_from_env || config.base_m % kStripeRows != 0) return config;
  EngineConfig wide = config;
  wide.sub_m = kStripeRows;
  if (n > config.base_n) {
    if (!rows_for_every_owner(config, m, world)) return config;
    wide.base_n = round_up_cols(n);
  }
  return wide;
}

EngineConfig wide_row_geometry(const EngineConfig& config, int64_t m, int64_t n, int world) {
  // Up to 2048 columns a tile: 64-row subtiles of fp32 stay at 512 KiB, which the comm block reduces in L2; wider
  // tiles save little more packing in the GEMM (docs/journal/performance-journal.md).
  constexpr int64_t kMaxCols = 2048;
  if (config.tile_from_env || !config.comm_inline || n <= config.base_n || !rows_for_every_owner(config, m, world)) {
    return config;
  }
  EngineConfig wide = config;
  const int64_t panels = (n + kMaxCols - 1) / kMaxCols;
  wide.base_n = round_up_cols((n + panels - 1) / panels);
  return wide;
}

EngineConfig tile_row_per_rank_geometry(const EngineConfig& config, int64_t m, int64_t n, int world) {
  const EngineConfig epilogue = row_epilogue_geometry(config, m, n, world);
  if (config.tile_from_env || !config.comm_inline || world < 1 || m <= 0 || n <= 0) return epilogue;
  EngineConfig tall = epilogue;
  const int64_t rows = std::max<int64_t>(1, (m + world - 1) / world);
  tall.sub_m = kStripeRows;
  tall.base_m = (rows + kStripeRows - 1) / kStripeRows * kStripeRows;
  tall.base_n = std::max(config.base_n, round_up_cols(n));
  tall.one_product = true;
  return tall;
}

EngineConfig decode_geometry(const EngineConfig& config, int64_t m, int64_t n) {
  if (config.tile_from_env || !config.comm_inline || m <= 0 || n <= 0 || m > kDecodeMaxRows) return config;
  EngineConfig decode = config;
  decode.base_m = m;
  decode.sub_m = m;
  decode.base_n = n;
  decode.one_product = true;
  decode.decode = true;
  return decode;
}

EngineConfig column_panel_geometry(const EngineConfig& config, int64_t m, int64_t n, int world) {
  if (config.tile_from_env || !config.comm_inline || world < 1 || m <= 0 || n <= 0) return config;  // empty: no tiles
  EngineConfig tall = config;
  tall.base_m = (m + config.sub_m - 1) / config.sub_m * config.sub_m;
  tall.base_n = round_up_cols((n + world - 1) / world);
  tall.one_product = true;
  return tall;
}

}  // namespace gemm_ar::cpu
