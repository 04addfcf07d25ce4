// The CPU kernel of pto::gemm_allreduce: the shared op flow with the CPU fused engine and the CPU `auto` policy.
#include <torch/library.h>

#include "common/op_flow.h"
#include "common/rank_agreement.h"
#include "cpu/auto_policy.h"
#include "cpu/cpu_backend.h"
#include "cpu/fused_engine.h"

namespace gemm_ar::cpu {

const BackendHooks& cpu_backend() {
  static const BackendHooks hooks{
      c10::DeviceType::CPU,
      {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble},
      [](const CallArgs&, c10d::ProcessGroup& group) { return FusedEngine::of(group).unavailable_reason(); },
      [](const CallArgs& call, c10d::ProcessGroup& group) { return FusedEngine::of(group).run(call); },
      [](const CallArgs& call, c10d::ProcessGroup& group, bool fused_available) {
        return choose_cpu_algorithm(call, group.getSize(), fused_available);
      },
      [](const CallArgs& call, Algorithm chosen, c10d::ProcessGroup& group) {
        FusedEngine& engine = FusedEngine::of(group);
        if (engine.has_windows()) {
          engine.agree(call, chosen);
        } else {
          check_ranks_agree(group, call, chosen, call.b.defined() ? call.b.device() : at::Device(at::kCPU));
        }
      },
  };
  return hooks;
}

namespace {

at::Tensor gemm_allreduce_cpu(const at::Tensor& a, const at::Tensor& b, c10::string_view group_name,
                              const std::optional<at::Tensor>& bias, c10::string_view algorithm) {
  return run_gemm_allreduce(a, b, std::string_view(group_name.data(), group_name.size()), bias,
                            std::string_view(algorithm.data(), algorithm.size()), cpu_backend());
}

}  // namespace
}  // namespace gemm_ar::cpu

TORCH_LIBRARY_IMPL(pto, CPU, m) { m.impl("gemm_allreduce", &gemm_ar::cpu::gemm_allreduce_cpu); }
