// pto::gemm_allreduce_add_rmsnorm (docs/decisions/0011-add-rmsnorm-epilogue.md): gemm_allreduce followed by the
// residual add and the next block's RMSNorm. Its schema and its autograd formula; the CPU kernel is
// cpu/add_rmsnorm_cpu_op.cpp, the fake kernel is in torch_gemm_ar/_registrations.py. Like gemm_allreduce, backward is
// local: both outputs are replicated, so their gradients are too, and every input gradient is a local product or a
// row-wise formula.
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include "common/weight_grad.h"

namespace gemm_ar {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using OpSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&, c10::string_view, double,
                                                       const std::optional<at::Tensor>&, c10::string_view,
                                                       const std::optional<at::Tensor>&,
                                                       const std::optional<at::Tensor>&, std::optional<at::ScalarType>);

const c10::TypedOperatorHandle<OpSignature>& out_of_place_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pto::gemm_allreduce_add_rmsnorm", "").typed<OpSignature>();
  return op;
}

std::tuple<at::Tensor, at::Tensor> call_below_autograd(
    const at::Tensor& a, const at::Tensor& b, const at::Tensor& residual, const at::Tensor& norm_weight,
    c10::string_view group_name, double eps, const std::optional<at::Tensor>& bias, c10::string_view algorithm,
    const std::optional<at::Tensor>& a_scale, const std::optional<at::Tensor>& b_scale,
    std::optional<at::ScalarType> out_dtype) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return out_of_place_op().call(a, b, residual, norm_weight, group_name, eps, bias, algorithm, a_scale, b_scale,
                                out_dtype);
}

class GemmAllreduceAddRmsNormFunction : public torch::autograd::Function<GemmAllreduceAddRmsNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b,
                               const at::Tensor& residual, const at::Tensor& norm_weight, c10::string_view group_name,
                               double eps, const std::optional<at::Tensor>& bias, c10::string_view algorithm,
                               const std::optional<at::Tensor>& a_scale, const std::optional<at::Tensor>& b_scale,
                               std::optional<at::ScalarType> out_dtype) {
    const bool has_bias = bias.has_value() && bias->defined();
    auto [out, normed] =
        call_below_autograd(a, b, residual, norm_weight, group_name, eps, bias, algorithm, a_scale, b_scale, out_dtype);
    // `out` is all the norm's backward needs (its statistics are recomputed from it, as in the forward). W8A16
    // differentiates with respect to a float a only, through b dequantized with b_scale (frozen weights:
    // docs/decisions/0020-quantized-ops.md).
    const bool w8a16 = b.scalar_type() == at::kChar && a.is_floating_point() && b_scale.has_value();
    ctx->save_for_backward({a, b, norm_weight, out, w8a16 ? *b_scale : at::Tensor()});
    ctx->saved_data["has_bias"] = has_bias;
    ctx->saved_data["eps"] = eps;
    return {out, normed};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& a = saved[0];
    const at::Tensor& b = saved[1];
    const at::Tensor& weight = saved[2];
    const at::Tensor& out = saved[3];
    const at::Tensor& b_scale = saved[4];
    const double eps = ctx->saved_data["eps"].toDouble();
    const int64_t n = out.size(-1);
    const auto acc = at::toOpMathType(out.scalar_type());  // fp32 for bf16/fp16, as in the forward statistics
    const at::Tensor x = out.reshape({-1, n}).to(acc);
    at::Tensor grad_total;  // d loss / d out, including the path through the norm
    at::Tensor grad_weight;
    if (grads[0].defined()) grad_total = grads[0].reshape({-1, n}).to(acc);
    if (grads[1].defined()) {
      // y = x * r * w with r = (mean(x^2) + eps)^-1/2: dy/dx = r * g*w - x * r^3 * mean(g*w*x).
      const at::Tensor g = grads[1].reshape({-1, n}).to(acc);
      const at::Tensor rstd = at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps);
      const at::Tensor gw = g * weight.to(acc);
      const at::Tensor through_norm = rstd * gw - x * rstd.pow(3) * (gw * x).mean(-1, /*keepdim=*/true);
      grad_total = grad_total.defined() ? grad_total + through_norm : through_norm;
      if (ctx->needs_input_grad(3)) grad_weight = (g * x * rstd).sum(0).to(weight.scalar_type());
    }
    at::Tensor grad_a, grad_b, grad_residual, grad_bias;
    if (grad_total.defined()) {
      const at::Tensor grad2d = grad_total.to(out.scalar_type());
      if (ctx->needs_input_grad(0) && b_scale.defined()) {  // W8A16: in fp32, rounded once to a's dtype
        const at::Tensor b_dequantized = b.to(at::kFloat) * b_scale.reshape({-1}).to(at::kFloat);
        grad_a = at::matmul(grad_total, b_dequantized.t()).to(a.scalar_type()).reshape(a.sizes());
      } else if (ctx->needs_input_grad(0)) {
        grad_a = at::matmul(grad2d, b.t()).reshape(a.sizes());
      }
      if (ctx->needs_input_grad(1)) grad_b = grad_of_b(b, a.reshape({-1, a.size(-1)}), grad2d);
      if (ctx->needs_input_grad(2)) grad_residual = grad2d.reshape(out.sizes());
      // needs_input_grad counts tensor inputs only: a, b, residual, norm_weight, then bias when given.
      if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(4))
        grad_bias = grad_total.sum(0).to(out.scalar_type());
    }
    return {grad_a,    grad_b,       grad_residual, grad_weight,  at::Tensor(), at::Tensor(),
            grad_bias, at::Tensor(), at::Tensor(),  at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> gemm_allreduce_add_rmsnorm_autograd(
    const at::Tensor& a, const at::Tensor& b, const at::Tensor& residual, const at::Tensor& norm_weight,
    c10::string_view group_name, double eps, const std::optional<at::Tensor>& bias, c10::string_view algorithm,
    const std::optional<at::Tensor>& a_scale, const std::optional<at::Tensor>& b_scale,
    std::optional<at::ScalarType> out_dtype) {
  auto outputs = GemmAllreduceAddRmsNormFunction::apply(a, b, residual, norm_weight, group_name, eps, bias, algorithm,
                                                        a_scale, b_scale, out_dtype);
  return {outputs[0], outputs[1]};
}

// gemm_allreduce_add_rmsnorm_ on a backend without its own in-place kernel (the NPU): the op, then the new residual
// stream copied into `residual`. Correct, but it saves no traffic; the CPU kernel adds into `residual` directly.
at::Tensor gemm_allreduce_add_rmsnorm_inplace_composite(const at::Tensor& a, const at::Tensor& b, at::Tensor& residual,
                                                        const at::Tensor& norm_weight, c10::string_view group_name,
                                                        double eps, const std::optional<at::Tensor>& bias,
                                                        c10::string_view algorithm,
                                                        const std::optional<at::Tensor>& a_scale,
                                                        const std::optional<at::Tensor>& b_scale,
                                                        std::optional<at::ScalarType> out_dtype) {
  auto [out, normed] = out_of_place_op().call(a, b, residual, norm_weight, group_name, eps, bias, algorithm, a_scale,
                                              b_scale, out_dtype);
  residual.copy_(out);
  return normed;
}

}  // namespace
}  // namespace gemm_ar

// The schemas: op_table.h. The in-place op is inference only (no backward).
TORCH_LIBRARY_IMPL(pto, CompositeExplicitAutograd, m) {
  m.impl("gemm_allreduce_add_rmsnorm_", &gemm_ar::gemm_allreduce_add_rmsnorm_inplace_composite);
}

// No derivative: inputs that require grad make backward raise (and version counters see the write to residual).
TORCH_LIBRARY_IMPL(pto, ADInplaceOrView, m) {
  m.impl("gemm_allreduce_add_rmsnorm_", torch::autograd::autogradNotImplementedInplaceOrViewFallback());
}

TORCH_LIBRARY_IMPL(pto, Autograd, m) {
  m.impl("gemm_allreduce_add_rmsnorm", &gemm_ar::gemm_allreduce_add_rmsnorm_autograd);
  m.impl("gemm_allreduce_add_rmsnorm_", torch::autograd::autogradNotImplementedFallback());
}
