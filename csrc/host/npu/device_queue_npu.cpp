// DeviceQueue on Ascend (npu/device_runtime.h): each function is the torch_npu call the host code made before the
// seam. Nothing here waits for the device: this is one of the per-call sources tests/test_npu_per_call_sync.py
// checks.
#include <torch_npu/csrc/core/npu/NPUCachingAllocator.h>
#include <torch_npu/csrc/core/npu/NPUEvent.h>
#include <torch_npu/csrc/core/npu/NPUFunctions.h>
#include <torch_npu/csrc/core/npu/NPUGraphsUtils.h>
#include <torch_npu/csrc/core/npu/NPUGuard.h>
#include <torch_npu/csrc/core/npu/NPUStream.h>
#include <torch_npu/csrc/framework/OpCommand.h>

#include "kernel_launch.h"
#include "npu/device_event_npu.h"
#include "npu/device_runtime.h"
#include "sp_kernel_launch.h"

namespace gemm_ar::npu {
namespace {

using LaunchShim = void (*)(uint32_t, void*, void*);

struct KernelEntry {
  const char* name;  // the task's name in torch_npu's queue (and its profiler)
  LaunchShim launch;
};

KernelEntry kernel_entry(Kernel kernel) {
  switch (kernel) {
    case Kernel::kGemmCompute: return {"gemm_ar_compute", &launch_gemm_compute};
    case Kernel::kGemmComm: return {"gemm_ar_comm", &launch_gemm_comm};
    case Kernel::kRsCompute: return {"gemm_ar_rs_compute", &launch_rs_compute};
    case Kernel::kRsComm: return {"gemm_ar_rs_comm", &launch_rs_comm};
    case Kernel::kAgCompute: return {"gemm_ar_ag_compute", &launch_ag_compute};
    case Kernel::kAgComm: return {"gemm_ar_ag_comm", &launch_ag_comm};
  }
  TORCH_INTERNAL_ASSERT(false, "unknown kernel ", static_cast<int>(kernel));
}

class NpuDeviceQueue final : public DeviceQueue {
 public:
  int32_t current_device() override { return c10_npu::current_device(); }
  c10::Stream current_stream(int32_t device) override {
    return c10_npu::getCurrentNPUStream(static_cast<c10::DeviceIndex>(device)).unwrap();
  }
  c10::Stream native_stream(NativeStream stream, int32_t device) override {
    return c10_npu::getStreamFromExternal(static_cast<aclrtStream>(stream), static_cast<c10::DeviceIndex>(device))
        .unwrap();
  }
  bool capturing() override { return c10_npu::currentStreamCaptureStatusMayInitCtx() != c10_npu::CaptureStatus::None; }

  at::Tensor empty(c10::IntArrayRef sizes, const at::TensorOptions& options) override {
    return at::empty(sizes, options);
  }
  at::Tensor empty_pinned(int64_t bytes) override {
    return at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  }
  void keep_alive(const c10::Stream& stream, const at::Tensor& tensor) override {
    c10_npu::NPUCachingAllocator::recordStream(tensor.storage().data_ptr(), c10_npu::NPUStream(stream));
  }

  void fill_zero(const c10::Stream& stream, const at::Tensor& tensor) override {
    c10_npu::NPUStreamGuard on_stream(stream);
    tensor.zero_();
  }
  void copy_async(const c10::Stream& stream, const at::Tensor& dst, const at::Tensor& src) override {
    c10_npu::NPUStreamGuard on_stream(stream);
    dst.copy_(src, /*non_blocking=*/true);
  }
  at::Tensor contiguous(const c10::Stream& stream, const at::Tensor& tensor) override {
    c10_npu::NPUStreamGuard on_stream(stream);
    return tensor.contiguous();
  }
  void increment_counter(const c10::Stream& stream, const at::Tensor& counter) override {
    c10_npu::NPUStreamGuard on_stream(stream);
    counter.add_(1);
  }
  // A raw kernel launch queued on torch_npu's task queue of `stream` (RunOpApi enqueues on the current stream); the
  // launch itself runs later, in order with every other operation queued on that stream.
  void launch(const c10::Stream& stream, Kernel kernel, uint32_t blocks, void* args_device) override {
    c10_npu::NPUStreamGuard on_stream(stream);
    const c10_npu::NPUStream npu_stream(stream);
    TORCH_INTERNAL_ASSERT(c10_npu::getCurrentNPUStream(npu_stream.device_index()) == npu_stream);
    aclrtStream raw = npu_stream.stream(false);
    const KernelEntry entry = kernel_entry(kernel);
    at_npu::native::OpCommand::RunOpApi(entry.name, [=]() -> int {
      entry.launch(blocks, raw, args_device);
      return 0;
    });
  }

  DeviceEvent record(const c10::Stream& stream, bool timing) override {
    auto event = timing ? std::make_shared<DeviceEventImpl>(ACL_EVENT_TIME_LINE) : std::make_shared<DeviceEventImpl>();
    event->event.record(c10_npu::NPUStream(stream));
    return event;
  }
  void stream_waits_for(const c10::Stream& stream, const DeviceEvent& event) override {
    event->event.block(c10_npu::NPUStream(stream));
  }
  bool query(const DeviceEvent& event) override { return event->event.query(); }
};

}  // namespace

DeviceQueue& device_queue() {
  // Never destroyed: the interpreter-exit check may still use it while static destructors run.
  static auto* queue = new NpuDeviceQueue();
  return *queue;
}

}  // namespace gemm_ar::npu
