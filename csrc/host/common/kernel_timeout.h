// The kernels' wait bound against the runtime's AI Core op-execute timeout. When a kernel runs longer than that
// timeout the runtime kills it, and the ErrorRecord naming the peer that never came is lost, so
// TORCH_GEMM_AR_TIMEOUT_S is capped below it with a margin (the kernels need a moment to record and poison).
// Sources (docs/ascend.md, "Timeouts and stragglers"): CANN reports the effective value in milliseconds through
// aclrtGetOpExecuteTimeout (CANN 8.5 on); torch_npu 2.13 sets it to 547 s when it initialises a device (CANN's own
// default on A2/A3 is 1091 s), so 547 s is what to assume where the runtime cannot be asked.
#pragma once
#include <algorithm>
#include <cstdint>

namespace gemm_ar {

constexpr int64_t kAssumedAiCoreTimeoutMs = 547 * 1000;  // torch_npu's; used when the runtime cannot be asked

struct KernelWaitBound {
  int64_t wait_ms;  // what the kernels get
  bool capped;      // the request was above the cap (warn, naming both values)
};

// The margin left between the kernels' own give-up and the runtime's kill: a tenth of it, at least 1 s.
inline int64_t kernel_wait_cap_ms(int64_t aicore_timeout_ms) {
  const int64_t margin = std::max<int64_t>(aicore_timeout_ms / 10, 1000);
  return std::max<int64_t>(aicore_timeout_ms - margin, 1);
}

inline KernelWaitBound kernel_wait_bound(int64_t requested_ms, int64_t aicore_timeout_ms) {
  if (aicore_timeout_ms <= 0) return {requested_ms, false};  // unknown: nothing to cap against
  const int64_t cap = kernel_wait_cap_ms(aicore_timeout_ms);
  if (requested_ms <= cap) return {requested_ms, false};
  return {cap, true};
}

}  // namespace gemm_ar
