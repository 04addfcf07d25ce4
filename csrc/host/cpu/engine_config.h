// Tile sizes and thread counts of the CPU fused engine, from the machine and the environment (README,
// "Configuration"). They are part of the call signature, so ranks configured differently get a clear error.
#pragma once
#include <cstdint>

namespace gemm_ar::cpu {

struct EngineConfig {
  int64_t base_m, base_n, sub_m;  // TORCH_GEMM_AR_CPU_TILE="rows,cols,subtile_rows" (default 256,512,64)
  int64_t compute_blocks;         // TORCH_GEMM_AR_COMPUTE_THREADS (default: this rank's share of the cores)
  int64_t comm_blocks;            // TORCH_GEMM_AR_COMM_THREADS (default 1)
};

EngineConfig engine_config(int local_ranks);

}  // namespace gemm_ar::cpu
