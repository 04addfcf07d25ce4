// The op's autograd formula (docs/decisions/0001-op-family-as-torch-library-ops.md): a row-parallel linear layer. The
// forward output is replicated, so the incoming gradient is too, and every gradient is a local product: no
// communication in backward.
// (torch.library.register_autograd cannot take this schema: bias is a keyword-only tensor.)
#include <torch/autograd.h>
#include <torch/library.h>

#include "common/weight_grad.h"

namespace gemm_ar {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor call_below_autograd(const at::Tensor& a, const at::Tensor& b, c10::string_view group_name,
                               const std::optional<at::Tensor>& bias, c10::string_view algorithm,
                               const std::optional<at::Tensor>& a_scale, const std::optional<at::Tensor>& b_scale,
                               std::optional<at::ScalarType> out_dtype) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pto::gemm_allreduce", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, const std::optional<at::Tensor>&,
                            c10::string_view, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                            std::optional<at::ScalarType>)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(a, b, group_name, bias, algorithm, a_scale, b_scale, out_dtype);
}

// W8A16's int8 b dequantized in fp32 with b_scale (per column or one value).
at::Tensor dequantized_b(const at::Tensor& b, const at::Tensor& b_scale) {
  return b.to(at::kFloat) * b_scale.reshape({-1}).to(at::kFloat);
}

class GemmAllreduceFunction : public torch::autograd::Function<GemmAllreduceFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b, c10::string_view group_name,
                            const std::optional<at::Tensor>& bias, c10::string_view algorithm,
                            const std::optional<at::Tensor>& a_scale, const std::optional<at::Tensor>& b_scale,
                            std::optional<at::ScalarType> out_dtype) {
    // Quantized calls differentiate with respect to a float a only (W8A16 with frozen weights): int8 tensors have
    // no gradient, and the scales are constants of the quantization (docs/decisions/0020-quantized-ops.md).
    const bool w8a16 = b.scalar_type() == at::kChar && a.is_floating_point();
    ctx->save_for_backward({a, b, w8a16 && b_scale.has_value() ? *b_scale : at::Tensor()});
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return call_below_autograd(a, b, group_name, bias, algorithm, a_scale, b_scale, out_dtype);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& a = saved[0];
    const at::Tensor& b = saved[1];
    const at::Tensor& b_scale = saved[2];
    auto grad2d = grads[0].reshape({-1, grads[0].size(-1)});
    at::Tensor grad_a, grad_b, grad_bias;
    if (ctx->needs_input_grad(0)) {
      if (b_scale.defined()) {  // W8A16: in fp32, rounded once to a's dtype
        grad_a = at::matmul(grad2d.to(at::kFloat), dequantized_b(b, b_scale).t()).to(a.scalar_type());
      } else {
        grad_a = at::matmul(grad2d, b.t());
      }
      grad_a = grad_a.reshape(a.sizes());
    }
    if (ctx->needs_input_grad(1)) grad_b = grad_of_b(b, a.reshape({-1, a.size(-1)}), grad2d);
    // needs_input_grad counts tensor inputs only: a, b, then bias when given.
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) grad_bias = grad2d.sum(0);
    return {grad_a, grad_b, at::Tensor(), grad_bias, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor gemm_allreduce_autograd(const at::Tensor& a, const at::Tensor& b, c10::string_view group_name,
                                   const std::optional<at::Tensor>& bias, c10::string_view algorithm,
                                   const std::optional<at::Tensor>& a_scale, const std::optional<at::Tensor>& b_scale,
                                   std::optional<at::ScalarType> out_dtype) {
  return GemmAllreduceFunction::apply(a, b, group_name, bias, algorithm, a_scale, b_scale, out_dtype);
}

}  // namespace
}  // namespace gemm_ar

TORCH_LIBRARY_IMPL(pto, Autograd, m) { m.impl("gemm_allreduce", &gemm_ar::gemm_allreduce_autograd); }
