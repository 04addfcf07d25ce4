// Helpers for never-reset, epoch-tagged uint32 counters (docs/decisions/0003-epoch-tagged-flags-never-reset.md): a
// counter that gets `per_call` increments in every call it takes part in has reached call e's target once it has
// advanced e * per_call past its start. Counters wrap modulo 2^32; comparisons are wrap-safe as long as no waiter lags
// the counter by 2^31 or more increments.
#pragma once
#include <cstdint>

#include "fn.hpp"

namespace gemm_ar {

// True once `value` has reached `target` in wrap-around order (value - target in [0, 2^31)).
GEMM_AR_FN bool counter_reached(uint32_t value, uint32_t target) {
  return static_cast<uint32_t>(value - target) < 0x80000000u;
}

// Bank (0 or 1) used by call number `call`: buffers alternate by call parity.
GEMM_AR_FN int64_t call_bank(uint64_t call) { return static_cast<int64_t>(call & 1u); }

}  // namespace gemm_ar
