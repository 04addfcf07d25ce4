// The NPU's clock for `auto` tuning calls (BackendHooks::start_device_clock): the call returns before its kernels
// ran, so its time is measured between two timing events on the caller's stream and read at the bucket's next call.
// Kept out of the per-call translation units: reading the clock waits for the device (tuning calls only).
#pragma once
#include <memory>

#include "common/op_flow.h"

namespace gemm_ar::npu {

// Records the start event on the current stream of the current device.
std::unique_ptr<DeviceClock> start_npu_clock();

// Whether the current stream is being captured into a graph.
bool npu_stream_capturing();

}  // namespace gemm_ar::npu
