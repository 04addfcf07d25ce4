// `algorithm="auto"` on CPU, its static policy (docs/decisions/0002-algorithms-and-measured-auto.md). Thresholds come
// from benchmarks/sweep.py (docs/journal/performance-journal.md, "Where `auto` switches"): fused wins from M=1 in the
// measured layers; chunked rarely beats sequential over loopback gloo.
// TORCH_GEMM_AR_AUTO_MIN_FUSED_ELEMS and TORCH_GEMM_AR_AUTO_MIN_CHUNKED_ROWS override them.
#pragma once
#include "common/algorithm.h"
#include "common/call_args.h"

namespace gemm_ar::cpu {

Algorithm choose_cpu_algorithm(const CallArgs& call, int world, bool fused_available);

}  // namespace gemm_ar::cpu
