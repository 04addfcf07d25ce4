// The NPU (PrivateUse1) kernels of pto::gemm_allreduce, pto::gemm_reduce_scatter and pto::allgather_gemm: the
// shared op flows with the HCCL process group for
// `sequential` and `chunked`, the PTO kernels for `fused`, and the NPU `auto` policy.
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <mutex>
#include <set>

#include "common/op_flow.h"
#include "common/sequence_parallel_flow.h"
#include "common/settings.h"
#include "npu/device_clock.h"
#include "npu/fused_npu.h"
#include "npu/npu_backend.h"

namespace gemm_ar::npu {
namespace {

// `auto` takes `sequential` below this many output rows, where one HCCL all_reduce after the GEMM is latency-bound
// and there is too little work to overlap (except gemm_allreduce at decode sizes, which takes the decode kernels). Not
// yet measured on hardware (docs/ascend.md); override with TORCH_GEMM_AR_NPU_FUSED_MIN_ROWS.
constexpr int64_t kDefaultFusedMinRows = 64;

const char* blocker_name(FusedBlocker blocker) {
  switch (blocker) {
    case FusedBlocker::kDtype: return "dtype";
    case FusedBlocker::kShape: return "shape";
    case FusedBlocker::kWorld: return "world size";
    case FusedBlocker::kBackend: return "backend";
    case FusedBlocker::kSymbols: return "CANN version";
    case FusedBlocker::kTopology: return "topology";
    case FusedBlocker::kSetup: return "HCCL setup";
    case FusedBlocker::kWindow: return "window size";
    case FusedBlocker::kNone: break;
  }
  return "unknown";
}

// One warning per kind of reason per process: a model calls the op thousands of times with the same problem.
void warn_fallback_once(const FusedCheck& check, const std::string& op_name, const char* fallback) {
  static std::mutex mutex;
  static std::set<std::pair<std::string, FusedBlocker>> warned;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!warned.insert({op_name, check.blocker}).second) return;
  }
  TORCH_WARN(op_name, ": algorithm='auto' uses '", fallback, "' instead of 'fused' on NPU (",
             blocker_name(check.blocker), "): ", check.reason, ". This warning is shown once per reason.");
}

Algorithm choose_auto(const CallArgs& call, c10d::ProcessGroup& group, bool fused_available) {
  // gemm_allreduce (and gemm_allreduce_add_rmsnorm) at decode sizes: `fused` runs the one-shot decode kernels there,
  // estimated to beat GEMM + HCCL all_reduce (docs/ascend.md, "Decode"; not yet measured on hardware).
  if (fused_available && fused_variant(call) == kVariantDecode) return Algorithm::Fused;
  const int64_t min_rows = env_int(Setting::kNpuFusedMinRows, kDefaultFusedMinRows, 0, INT64_MAX);
  if (call.m < min_rows) return Algorithm::Sequential;
  if (fused_available) return Algorithm::Fused;
  // The sequence-parallel ops have no `chunked`: their fallback is `sequential` (reason worded in the warning).
  const bool sequence_parallel = call.op == kOpGemmReduceScatter || call.op == kOpAllgatherGemm;
  if (sequence_parallel) {
    warn_fallback_once(check_fused(call, group), call.op_name, "sequential");
    return Algorithm::Sequential;
  }
  // Asked again only to word the warning; the communicator is cached, so this is cheap and gives the same answer.
  warn_fallback_once(check_fused(call, group), call.op_name, "chunked");
  return Algorithm::Chunked;
}

BackendHooks make_npu_backend() {
  BackendHooks hooks;
  hooks.device_type = c10::DeviceType::PrivateUse1;
  hooks.dtypes = {at::kHalf, at::kBFloat16};
  hooks.fused_unavailable_reason = [](const CallArgs& call, c10d::ProcessGroup& group) {
    return check_fused(call, group).reason;
  };
  hooks.run_fused = [](const CallArgs& call, c10d::ProcessGroup& group) { return run_fused(call, group); };
  hooks.choose_auto = &choose_auto;
  // After the group's first fused call, fused calls agree inside the comm kernel, not over the process group.
  hooks.check_agreement = &agree_fused;
  // `auto` by measurement, as on CPU, each tuning call timed by events on the device
  // (docs/decisions/0002-algorithms-and-measured-auto.md).
  hooks.measured_auto = true;
  hooks.start_device_clock = &start_npu_clock;
  hooks.capturing = &npu_stream_capturing;
  hooks.run_fused_reduce_scatter = &run_fused_reduce_scatter;
  hooks.run_fused_allgather = &run_fused_allgather;
  return hooks;
}

}  // namespace

const BackendHooks& npu_backend() {
  static const BackendHooks hooks = make_npu_backend();
  return hooks;
}

namespace {

// Quantized arguments reach the op flow, which makes every rank raise NotImplementedError for them (the backend has
// no quantized path yet: docs/ascend.md).
at::Tensor gemm_allreduce_npu(const at::Tensor& a, const at::Tensor& b, c10::string_view group_name,
                              const std::optional<at::Tensor>& bias, c10::string_view algorithm,
                              const std::optional<at::Tensor>& a_scale, const std::optional<at::Tensor>& b_scale,
                              std::optional<at::ScalarType> out_dtype) {
  // Custom ops get no device guard from the dispatcher; every launch below must target a's device.
  c10::DeviceGuard device_guard(a.device());
  return run_gemm_allreduce(a, b, std::string_view(group_name.data(), group_name.size()), bias,
                            std::string_view(algorithm.data(), algorithm.size()), npu_backend(), {}, "gemm_allreduce",
                            QuantInputs{a_scale, b_scale, out_dtype});
}

std::string_view view_of(c10::string_view s) { return std::string_view(s.data(), s.size()); }

at::Tensor gemm_reduce_scatter_npu(const at::Tensor& a, const at::Tensor& b, c10::string_view group_name,
                                   int64_t scatter_dim, const std::optional<at::Tensor>& bias,
                                   c10::string_view algorithm) {
  c10::DeviceGuard device_guard(a.device());
  return run_gemm_reduce_scatter(a, b, view_of(group_name), scatter_dim, bias, view_of(algorithm), npu_backend());
}

std::tuple<at::Tensor, std::optional<at::Tensor>> allgather_gemm_npu(const at::Tensor& a, const at::Tensor& b,
                                                                     c10::string_view group_name, int64_t gather_dim,
                                                                     const std::optional<at::Tensor>& bias,
                                                                     bool return_gathered, c10::string_view algorithm) {
  c10::DeviceGuard device_guard(a.device());
  return run_allgather_gemm(a, b, view_of(group_name), gather_dim, bias, return_gathered, view_of(algorithm),
                            npu_backend());
}

}  // namespace
}  // namespace gemm_ar::npu

TORCH_LIBRARY_IMPL(pto, PrivateUse1, m) {
  m.impl("gemm_allreduce", &gemm_ar::npu::gemm_allreduce_npu);
  m.impl("gemm_reduce_scatter", &gemm_ar::npu::gemm_reduce_scatter_npu);
  m.impl("allgather_gemm", &gemm_ar::npu::allgather_gemm_npu);
}
