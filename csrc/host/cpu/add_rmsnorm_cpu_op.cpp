// The CPU kernels of pto::gemm_allreduce_add_rmsnorm and its in-place variant: the CPU backend's gemm_allreduce with
// the add+RMSNorm epilogue (common/add_rmsnorm.h), which the fused engine runs per row block during its copy-out.
#include <torch/library.h>

#include "common/add_rmsnorm.h"
#include "cpu/cpu_backend.h"
#include "cpu/fused_engine.h"
#include "cpu/output_pool.h"

namespace gemm_ar::cpu {
namespace {

at::Tensor run_fused_with_epilogue(const CallArgs& call, c10d::ProcessGroup& group, const RowEpilogue& rows,
                                   const at::Tensor& add_into) {
  return engine_of_this_call(group).run(call, rows, add_into);
}

std::tuple<at::Tensor, at::Tensor> gemm_allreduce_add_rmsnorm_cpu(
    const at::Tensor& a, const at::Tensor& b, const at::Tensor& residual, const at::Tensor& norm_weight,
    c10::string_view group_name, double eps, const std::optional<at::Tensor>& bias, c10::string_view algorithm,
    const std::optional<at::Tensor>& a_scale, const std::optional<at::Tensor>& b_scale,
    std::optional<at::ScalarType> out_dtype) {
  const std::string_view name(group_name.data(), group_name.size());
  std::tuple<at::Tensor, at::Tensor> result;
  with_call_engine("gemm_allreduce_add_rmsnorm", name, [&] {
    // A fresh [M, N] buffer costs page faults on every call (cpu/output_pool.h): normed is pooled like out.
    result = run_gemm_allreduce_add_rmsnorm(a, b, residual, norm_weight, name, eps, bias,
                                            std::string_view(algorithm.data(), algorithm.size()), cpu_backend(),
                                            &run_fused_with_epilogue, &pooled_empty,
                                            QuantInputs{a_scale, b_scale, out_dtype});
  });
  return result;
}

at::Tensor gemm_allreduce_add_rmsnorm_inplace_cpu(const at::Tensor& a, const at::Tensor& b, at::Tensor& residual,
                                                  const at::Tensor& norm_weight, c10::string_view group_name,
                                                  double eps, const std::optional<at::Tensor>& bias,
                                                  c10::string_view algorithm, const std::optional<at::Tensor>& a_scale,
                                                  const std::optional<at::Tensor>& b_scale,
                                                  std::optional<at::ScalarType> out_dtype) {
  const std::string_view name(group_name.data(), group_name.size());
  at::Tensor normed;
  with_call_engine("gemm_allreduce_add_rmsnorm_", name, [&] {
    normed = run_gemm_allreduce_add_rmsnorm_inplace(a, b, residual, norm_weight, name, eps, bias,
                                                    std::string_view(algorithm.data(), algorithm.size()), cpu_backend(),
                                                    &run_fused_with_epilogue, &pooled_empty,
                                                    QuantInputs{a_scale, b_scale, out_dtype});
  });
  return normed;
}

}  // namespace
}  // namespace gemm_ar::cpu

TORCH_LIBRARY_IMPL(pto, CPU, m) {
  m.impl("gemm_allreduce_add_rmsnorm", &gemm_ar::cpu::gemm_allreduce_add_rmsnorm_cpu);
  m.impl("gemm_allreduce_add_rmsnorm_", &gemm_ar::cpu::gemm_allreduce_add_rmsnorm_inplace_cpu);
}
