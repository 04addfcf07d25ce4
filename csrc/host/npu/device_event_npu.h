// DeviceEvent on Ascend: a torch_npu event. Shared by the two halves of the NPU runtime (device_queue_npu.cpp records
// and queries, device_control_npu.cpp waits and measures); host logic never includes this.
#pragma once
#include <torch_npu/csrc/core/npu/NPUEvent.h>

#include "npu/device_runtime.h"

namespace gemm_ar::npu {

struct DeviceEventImpl {
  DeviceEventImpl() = default;
  explicit DeviceEventImpl(unsigned int flags) : event(flags) {}
  c10_npu::NPUEvent event;
};

}  // namespace gemm_ar::npu
