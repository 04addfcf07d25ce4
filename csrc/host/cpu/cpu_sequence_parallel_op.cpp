// The CPU kernels of pto::gemm_reduce_scatter and pto::allgather_gemm: the shared sequence-parallel flow with the
// CPU fused engine (its reduce-scatter and all-gather calls), the same `auto` (measured tuner) and the same
// agreement through the engine's window headers as gemm_allreduce.
#include <torch/library.h>

#include "common/sequence_parallel_flow.h"
#include "cpu/cpu_backend.h"
#include "cpu/fused_engine.h"

namespace gemm_ar::cpu {
namespace {

std::string_view view_of(c10::string_view s) { return std::string_view(s.data(), s.size()); }

// gemm_allreduce's CPU backend with the engine's reduce-scatter and all-gather calls; `auto` never picks `chunked`
// (these ops have none).
const BackendHooks& cpu_sequence_parallel_backend() {
  static const BackendHooks hooks = [] {
    BackendHooks h = cpu_backend();
    h.run_fused_reduce_scatter = [](const CallArgs& call, c10d::ProcessGroup& group) {
      return engine_of_this_call(group).run(call);
    };
    h.run_fused_allgather = [](const CallArgs& call, c10d::ProcessGroup& group) {
      return engine_of_this_call(group).run_allgather(call);
    };
    h.choose_auto = [inner = h.choose_auto](const CallArgs& call, c10d::ProcessGroup& group, bool fused_available) {
      const Algorithm chosen = inner(call, group, fused_available);
      return chosen == Algorithm::Chunked ? Algorithm::Sequential : chosen;
    };
    return h;
  }();
  return hooks;
}

at::Tensor gemm_reduce_scatter_cpu(const at::Tensor& a, const at::Tensor& b, c10::string_view group_name,
                                   int64_t scatter_dim, const std::optional<at::Tensor>& bias,
                                   c10::string_view algorithm) {
  at::Tensor out;
  with_call_engine("gemm_reduce_scatter", view_of(group_name), [&] {
    out = run_gemm_reduce_scatter(a, b, view_of(group_name), scatter_dim, bias, view_of(algorithm),
                                  cpu_sequence_parallel_backend());
  });
  return out;
}

std::tuple<at::Tensor, std::optional<at::Tensor>> allgather_gemm_cpu(const at::Tensor& a, const at::Tensor& b,
                                                                     c10::string_view group_name, int64_t gather_dim,
                                                                     const std::optional<at::Tensor>& bias,
                                                                     bool return_gathered, c10::string_view algorithm) {
  std::tuple<at::Tensor, std::optional<at::Tensor>> result;
  with_call_engine("allgather_gemm", view_of(group_name), [&] {
    result = run_allgather_gemm(a, b, view_of(group_name), gather_dim, bias, return_gathered, view_of(algorithm),
                                cpu_sequence_parallel_backend());
  });
  return result;
}

}  // namespace
}  // namespace gemm_ar::cpu

TORCH_LIBRARY_IMPL(pto, CPU, m) {
  m.impl("gemm_reduce_scatter", &gemm_ar::cpu::gemm_reduce_scatter_cpu);
  m.impl("allgather_gemm", &gemm_ar::cpu::allgather_gemm_cpu);
}
