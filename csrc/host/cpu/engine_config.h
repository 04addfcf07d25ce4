// Tile sizes and thread counts of the CPU fused engine, from the machine and the environment (README,
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
};

EngineConfig engine_config(int local_ranks);

}  // namespace gemm_ar::cpu
