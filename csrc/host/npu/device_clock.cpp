#include "npu/device_clock.h"

#include <chrono>
#include <thread>

#include "common/settings.h"
#include "npu/device_runtime.h"

namespace gemm_ar::npu {
namespace {

class NpuEventClock final : public DeviceClock {
 public:
  NpuEventClock() : start_(record_now()) {}

  void stop() override { stop_ = record_now(); }

  // Polls rather than blocks, so that kernels that never finish (a peer that never came) raise after
  // TORCH_GEMM_AR_TIMEOUT_S instead of hanging the caller.
  double seconds() override {
    TORCH_INTERNAL_ASSERT(stop_ != nullptr, "the clock was read before it was stopped");
    const auto deadline = std::chrono::steady_clock::now() + wait_timeout();
    while (!device_queue().query(stop_)) {
      TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "the call's kernels did not finish within ",
                  wait_timeout().count() / 1000.0, " s (TORCH_GEMM_AR_TIMEOUT_S)");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return device_control().elapsed_ms(start_, stop_) * 1e-3;
  }

 private:
  // A timing event on the current stream of the current device.
  static DeviceEvent record_now() {
    DeviceQueue& queue = device_queue();
    return queue.record(queue.current_stream(queue.current_device()), /*timing=*/true);
  }

  DeviceEvent start_;
  DeviceEvent stop_;
};

}  // namespace

std::unique_ptr<DeviceClock> start_npu_clock() { return std::make_unique<NpuEventClock>(); }

bool npu_stream_capturing() { return device_queue().capturing(); }

}  // namespace gemm_ar::npu
