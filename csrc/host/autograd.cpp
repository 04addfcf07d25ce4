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
                               const std::optional<at::Tensor>& bias, c10::string_view algorithm) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pto::gemm_allreduce", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view,
                                         const std::optional<at::Tensor>&, c10::string_view)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(a, b, group_name, bias, algorithm);
}

class GemmAllreduceFunction : public torch::autograd::Function<GemmAllreduceFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b, c10::string_view group_name,
                            const std::optional<at::Tensor>& bias, c10::string_view algorithm) {
    ctx->save_for_backward({a, b});
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return call_below_autograd(a, b, group_name, bias, algorithm);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& a = saved[0];
    const at::Tensor& b = saved[1];
    auto grad2d = grads[0].reshape({-1, grads[0].size(-1)});
    at::Tensor grad_a, grad_b, grad_bias;
    if (ctx->needs_input_grad(0)) grad_a = at::matmul(grad2d, b.t()).reshape(a.sizes());
    if (ctx->needs_input_grad(1)) grad_b = grad_of_b(b, a.reshape({-1, a.size(-1)}), grad2d);
    // needs_input_grad counts tensor inputs only: a, b, then bias when given.
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) grad_bias = grad2d.sum(0);
    return {grad_a, grad_b, at::Tensor(), grad_bias, at::Tensor()};
  }
};

at::Tensor gemm_allreduce_autograd(const at::Tensor& a, const at::Tensor& b, c10::string_view group_name,
                                   const std::optional<at::Tensor>& bias, c10::string_view algorithm) {
  return GemmAllreduceFunction::apply(a, b, group_name, bias, algorithm);
}

}  // namespace
}  // namespace gemm_ar

TORCH_LIBRARY_IMPL(pto, Autograd, m) { m.impl("gemm_allreduce", &gemm_ar::gemm_allreduce_autograd); }
