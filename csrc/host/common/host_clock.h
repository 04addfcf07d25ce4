// A wall clock that ranks of one host can compare: `auto`'s tuner times a candidate from the moment the last rank
// starts it, which needs every rank's start and end on one time line (common/auto_tuner.h).
#pragma once
#include <cstdint>

namespace gemm_ar {

// CLOCK_MONOTONIC in microseconds: one time line for every process of one kernel boot and time namespace.
int64_t monotonic_us();

// Which time line monotonic_us() is on: equal on two ranks only when their readings are comparable (same kernel
// boot and time namespace). Positive.
int64_t monotonic_clock_domain();

}  // namespace gemm_ar
