// The add+RMSNorm epilogue of gemm_allreduce_add_rmsnorm (docs/decisions/0011-add-rmsnorm-epilogue.md): the residual
// add and the next block's RMSNorm right after the reduction. out = reduced + residual (the new residual stream,
// rounded to the call dtype); normed = out * rsqrt(mean(out^2, -1) + eps) * weight, with the row statistics in fp32
// (fp64 for double).
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string_view>

#include "common/op_flow.h"
#include "common/row_epilogue.h"

namespace gemm_ar {

// Checks `residual` (shape a.shape[:-1] + [N], a's dtype and device) and `norm_weight` ([N], a's dtype and
// device) of a call whose a/b/bias passed; records the first problem in call.error/error_code.
void check_add_rmsnorm_args(CallArgs& call, const at::Tensor& residual, const at::Tensor& norm_weight, double eps);

// Rows [row0, row0 + rows) of an [M, N] row-major `out`: out += residual (in place), normed = RMSNorm(out); an
// undefined `residual`: out already holds the sum (the in-place variant), normed = RMSNorm(out) only.
// `residual` and `weight` are contiguous; deterministic (fixed summation order, the same whatever thread or
// `parallel`), so equal inputs give bitwise equal outputs on every rank. `parallel`: spread rows over the intra-op
// pool (only from the caller's thread).
void add_rmsnorm_rows(at::Tensor& out2d, const at::Tensor& residual2d, const at::Tensor& weight, double eps,
                      at::Tensor& normed2d, int64_t row0, int64_t rows, bool parallel);

// A fused path that runs a per-row-block epilogue itself (common/row_epilogue.h). A defined `add_into` (contiguous
// [M, N]): the path adds its result into that tensor, which is its output (the in-place variant).
using FusedWithEpilogue =
    std::function<at::Tensor(const CallArgs&, c10d::ProcessGroup&, const RowEpilogue&, const at::Tensor& add_into)>;

// An uninitialised [rows, cols] output on the call's device (a backend's pool; empty: at::empty).
using OutputAllocator = std::function<at::Tensor(int64_t rows, int64_t cols, at::ScalarType dtype)>;

// The whole op: the backend's gemm_allreduce (same checks, agreement and algorithm), then the epilogue: inside
// the fused path when `fused_with_epilogue` is given and the call runs fused, otherwise as one pass afterwards.
// `normed` comes from `allocate_normed` when given.
std::tuple<at::Tensor, at::Tensor> run_gemm_allreduce_add_rmsnorm(
    const at::Tensor& a, const at::Tensor& b, const at::Tensor& residual, const at::Tensor& norm_weight,
    std::string_view group_name, double eps, const std::optional<at::Tensor>& bias, std::string_view algorithm,
    const BackendHooks& backend, const FusedWithEpilogue& fused_with_epilogue,
    const OutputAllocator& allocate_normed = {}, const QuantInputs& quant = {});

// The epilogue's operands as a call gets them: residual [M, N] and weight [N] contiguous, normed [M, N] to fill.
// in_place: the fused path adds its sum into residual2d (the in-place variant's output) instead of a new output.
struct AddRmsNormOperands {
  at::Tensor residual2d, weight, normed2d;
  double eps = 0;
  bool in_place = false;
};

// gemm_allreduce_add_rmsnorm_ (in place): the same op, with the new residual stream written into `residual`
// itself; returns normed. The fused path adds the reduced sum straight into `residual` during the reduction and
// the copy-out, so no separate output is written and read back.
at::Tensor run_gemm_allreduce_add_rmsnorm_inplace(const at::Tensor& a, const at::Tensor& b, const at::Tensor& residual,
                                                  const at::Tensor& norm_weight, std::string_view group_name,
                                                  double eps, const std::optional<at::Tensor>& bias,
                                                  std::string_view algorithm, const BackendHooks& backend,
                                                  const FusedWithEpilogue& fused_with_epilogue,
                                                  const OutputAllocator& allocate_normed = {},
                                                  const QuantInputs& quant = {});

// The in-place variant's extra checks: `residual` has no overlapping elements and shares no memory with a, b,
// norm_weight or bias.
void check_in_place_residual(CallArgs& call, const at::Tensor& residual, const at::Tensor& a, const at::Tensor& b,
                             const at::Tensor& norm_weight, const std::optional<at::Tensor>& bias);

// A fused path that applies the epilogue on the device itself (the NPU comm kernel): returns `out` (call.out_shape)
// and has filled ops.normed2d.
using FusedAddRmsNorm = std::function<at::Tensor(const CallArgs&, c10d::ProcessGroup&, const AddRmsNormOperands& ops)>;

// The same op for a device backend whose memory the row loop cannot read: the epilogue inside `fused_add_rmsnorm`
// when the call runs fused, otherwise add_rmsnorm_tensor_ops() after the backend's unfused gemm_allreduce.
std::tuple<at::Tensor, at::Tensor> run_gemm_allreduce_add_rmsnorm_on_device(
    const at::Tensor& a, const at::Tensor& b, const at::Tensor& residual, const at::Tensor& norm_weight,
    std::string_view group_name, double eps, const std::optional<at::Tensor>& bias, std::string_view algorithm,
    const BackendHooks& backend, const FusedAddRmsNorm& fused_add_rmsnorm, const QuantInputs& quant = {});

// The epilogue with ATen operations on whatever device out2d lives: out2d = round(out2d + residual) in place,
// normed = RMSNorm(out2d) with fp32 statistics. Queued on the current stream; deterministic for equal inputs.
void add_rmsnorm_tensor_ops(at::Tensor& out2d, const AddRmsNormOperands& ops);

}  // namespace gemm_ar
