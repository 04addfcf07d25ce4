#include "cpu/auto_policy.h"

#include "common/settings.h"

namespace gemm_ar::cpu {

Algorithm choose_cpu_algorithm(const CallArgs& call, int world, bool fused_available) {
  // Output elements (M*N) from which the fused engine beats one gloo all_reduce; below it the call is tiny and
  // latency-bound either way.
  const int64_t min_fused = env_int(Setting::kAutoMinFusedElems, 1, 0, int64_t{1} << 62);
  // Rows from which chunking pays off over a single all_reduce (groups without shared windows). On one host over gloo
  // it rarely beats sequential (docs/journal/performance-journal.md, "Where `auto` switches"), so by default never;
  // set it for multi-host groups where the all_reduce is long enough to hide a GEMM chunk.
  const int64_t min_chunked_rows = env_int(Setting::kAutoMinChunkedRows, int64_t{1} << 62, 1, int64_t{1} << 62);
  if (fused_available && call.m * call.n >= min_fused) return Algorithm::Fused;
  return call.m >= min_chunked_rows ? Algorithm::Chunked : Algorithm::Sequential;
}

}  // namespace gemm_ar::cpu
