// The NPU (PrivateUse1) kernel of pto::gemm_allreduce_add_rmsnorm (docs/decisions/0011-add-rmsnorm-epilogue.md):
// gemm_allreduce's NPU flow, with the residual add and RMSNorm inside the comm kernel when the call runs `fused`
// (csrc/kernels/add_rmsnorm_epilogue.hpp), and as ATen operations on the reduced tensor after `sequential` /
// `chunked` (the library's unfused path).
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "common/add_rmsnorm.h"
#include "npu/fused_npu.h"
#include "npu/npu_backend.h"

namespace gemm_ar::npu {
namespace {

std::tuple<at::Tensor, at::Tensor> gemm_allreduce_add_rmsnorm_npu(
    const at::Tensor& a, const at::Tensor& b, const at::Tensor& residual, const at::Tensor& norm_weight,
    c10::string_view group_name, double eps, const std::optional<at::Tensor>& bias, c10::string_view algorithm,
    const std::optional<at::Tensor>& a_scale, const std::optional<at::Tensor>& b_scale,
    std::optional<at::ScalarType> out_dtype) {
  // Custom ops get no device guard from the dispatcher; every launch below must target a's device.
  c10::DeviceGuard device_guard(a.device());
  return run_gemm_allreduce_add_rmsnorm_on_device(a, b, residual, norm_weight,
                                                  std::string_view(group_name.data(), group_name.size()), eps, bias,
                                                  std::string_view(algorithm.data(), algorithm.size()), npu_backend(),
                                                  &run_fused_add_rmsnorm, QuantInputs{a_scale, b_scale, out_dtype});
}

}  // namespace
}  // namespace gemm_ar::npu

TORCH_LIBRARY_IMPL(pto, PrivateUse1, m) {
  m.impl("gemm_allreduce_add_rmsnorm", &gemm_ar::npu::gemm_allreduce_add_rmsnorm_npu);
}
