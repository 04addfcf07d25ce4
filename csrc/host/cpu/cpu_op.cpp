// The CPU kernel of pto::gemm_allreduce.
#include <torch/library.h>

#include "common/op_flow.h"

namespace gemm_ar {
namespace {

// Below this many output rows the all_reduce is latency-bound and one call beats chunking.
constexpr int64_t kChunkedMinRows = 256;

const BackendHooks& cpu_backend() {
  static const BackendHooks hooks{
      c10::DeviceType::CPU,
      {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble},
      [](const CallArgs&, c10d::ProcessGroup&) -> std::string {
        return "the CPU fused engine is not built into this version";
      },
      [](const CallArgs&, c10d::ProcessGroup&) -> at::Tensor {
        TORCH_CHECK(false, "gemm_allreduce: the CPU fused engine is not built into this version");
      },
      [](const CallArgs& call, c10d::ProcessGroup&, bool) {
        return call.m < kChunkedMinRows ? Algorithm::Sequential : Algorithm::Chunked;
      },
  };
  return hooks;
}

at::Tensor gemm_allreduce_cpu(const at::Tensor& a, const at::Tensor& b, c10::string_view group_name,
                              const std::optional<at::Tensor>& bias, c10::string_view algorithm) {
  return run_gemm_allreduce(a, b, std::string_view(group_name.data(), group_name.size()), bias,
                            std::string_view(algorithm.data(), algorithm.size()), cpu_backend());
}

}  // namespace
}  // namespace gemm_ar

TORCH_LIBRARY_IMPL(pto, CPU, m) { m.impl("gemm_allreduce", &gemm_ar::gemm_allreduce_cpu); }
