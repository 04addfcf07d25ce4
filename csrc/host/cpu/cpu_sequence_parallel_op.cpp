// The CPU kernels of pto::gemm_reduce_scatter and pto::allgather_gemm: the shared sequence-parallel flow with
// `sequential` only (the CPU fused engine does not run these ops yet, so `auto` resolves to sequential).
#include <torch/library.h>

#include "common/sequence_parallel_flow.h"

namespace gemm_ar::cpu {
namespace {

std::string_view view_of(c10::string_view s) { return std::string_view(s.data(), s.size()); }

const BackendHooks& cpu_sequence_parallel_backend() {
  static const BackendHooks hooks{
      c10::DeviceType::CPU,
      {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble},
      [](const CallArgs& call, c10d::ProcessGroup&) {
        return "the fused algorithm is not available yet for " + call.op_name + " on CPU";
      },
      nullptr,
      [](const CallArgs&, c10d::ProcessGroup&, bool) { return Algorithm::Sequential; },
      nullptr,  // agreement over the process group (these ops do not use the engine's windows)
  };
  return hooks;
}

at::Tensor gemm_reduce_scatter_cpu(const at::Tensor& a, const at::Tensor& b, c10::string_view group_name,
                                   int64_t scatter_dim, const std::optional<at::Tensor>& bias,
                                   c10::string_view algorithm) {
  return run_gemm_reduce_scatter(a, b, view_of(group_name), scatter_dim, bias, view_of(algorithm),
                                 cpu_sequence_parallel_backend());
}

std::tuple<at::Tensor, std::optional<at::Tensor>> allgather_gemm_cpu(
    const at::Tensor& a, const at::Tensor& b, c10::string_view group_name, int64_t gather_dim,
    const std::optional<at::Tensor>& bias, bool return_gathered, c10::string_view algorithm) {
  return run_allgather_gemm(a, b, view_of(group_name), gather_dim, bias, return_gathered, view_of(algorithm),
                            cpu_sequence_parallel_backend());
}

}  // namespace
}  // namespace gemm_ar::cpu

TORCH_LIBRARY_IMPL(pto, CPU, m) {
  m.impl("gemm_reduce_scatter", &gemm_ar::cpu::gemm_reduce_scatter_cpu);
  m.impl("allgather_gemm", &gemm_ar::cpu::allgather_gemm_cpu);
}
