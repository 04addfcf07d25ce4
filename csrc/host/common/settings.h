// Run-time knobs read from the environment (documented in docs/usage.md, "Configuration").
#pragma once
#include <chrono>
#include <cstdint>

namespace gemm_ar {

// TORCH_GEMM_AR_TIMEOUT_S (default 300): bound of every wait on a peer, in seconds.
std::chrono::milliseconds wait_timeout();
// TORCH_GEMM_AR_CHUNKS (default 4): number of M chunks of the `chunked` algorithm.
int64_t chunk_count();
// Reads an integer environment variable; `fallback` when unset; throws naming the variable when malformed.
int64_t env_int(const char* name, int64_t fallback, int64_t min_value, int64_t max_value);
double env_double(const char* name, double fallback, double min_value, double max_value);

}  // namespace gemm_ar
