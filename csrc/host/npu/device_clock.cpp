#include "npu/device_clock.h"

#include <torch_npu/csrc/core/npu/NPUEvent.h>
#include <torch_npu/csrc/core/npu/NPUGraphsUtils.h>
#include <torch_npu/csrc/core/npu/NPUStream.h>

#include <chrono>
#include <thread>

#include "common/settings.h"

namespace gemm_ar::npu {
namespace {

class NpuEventClock final : public DeviceClock {
 public:
  NpuEventClock() : start_(ACL_EVENT_TIME_LINE), stop_(ACL_EVENT_TIME_LINE) {
    start_.record(c10_npu::getCurrentNPUStream());
  }

  void stop() override { stop_.record(c10_npu::getCurrentNPUStream()); }

  // Polls rather than blocks, so that kernels that never finish (a peer that never came) raise after
  // TORCH_GEMM_AR_TIMEOUT_S instead of hanging the caller.
  double seconds() override {
    const auto deadline = std::chrono::steady_clock::now() + wait_timeout();
    while (!stop_.query()) {
      TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "the call's kernels did not finish within ",
                  wait_timeout().count() / 1000.0, " s (TORCH_GEMM_AR_TIMEOUT_S)");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return static_cast<double>(start_.elapsed_time(stop_)) * 1e-3;  // elapsed_time is in milliseconds
  }

 private:
  c10_npu::NPUEvent start_;
  c10_npu::NPUEvent stop_;
};

}  // namespace

std::unique_ptr<DeviceClock> start_npu_clock() { return std::make_unique<NpuEventClock>(); }

bool npu_stream_capturing() { return c10_npu::currentStreamCaptureStatusMayInitCtx() != c10_npu::CaptureStatus::None; }

}  // namespace gemm_ar::npu
