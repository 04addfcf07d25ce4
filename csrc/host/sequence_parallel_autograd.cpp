// Autograd of the sequence-parallel ops (Megatron's reduce_scatter_to_sequence_parallel_region /
// gather_from_sequence_parallel_region): each op's backward is the other op along the same dim, called through the
// dispatcher so that torch.compile traces it with the fake kernels and it runs whatever algorithm the forward ran.
//   GEMM+RS: grad_a = all_gather(g) @ b^T (allgather_gemm, which also returns the gathered g for grad_b).
//   AG+GEMM: grad_a = reduce_scatter(g @ b^T) (gemm_reduce_scatter); grad_b from the gathered a saved in forward.
// The gathered a that allgather_gemm can return is not differentiable (marked so): gradients flow through `out`.
#include <torch/autograd.h>
#include <torch/library.h>

#include "common/weight_grad.h"

namespace gemm_ar {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using GatherResult = std::tuple<at::Tensor, std::optional<at::Tensor>>;

const auto& gemm_reduce_scatter_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pto::gemm_reduce_scatter", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, int64_t,
                                         const std::optional<at::Tensor>&, c10::string_view)>();
  return op;
}

const auto& allgather_gemm_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pto::allgather_gemm", "")
                       .typed<GatherResult(const at::Tensor&, const at::Tensor&, c10::string_view, int64_t,
                                           const std::optional<at::Tensor>&, bool, c10::string_view)>();
  return op;
}

at::Tensor rows_of(const at::Tensor& t) { return t.reshape({-1, t.size(-1)}); }

class GemmReduceScatterFunction : public torch::autograd::Function<GemmReduceScatterFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b, c10::string_view group_name,
                            int64_t scatter_dim, const std::optional<at::Tensor>& bias, c10::string_view algorithm) {
    ctx->save_for_backward({a, b});
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["group_name"] = std::string(group_name);
    ctx->saved_data["dim"] = scatter_dim;
    ctx->saved_data["algorithm"] = std::string(algorithm);
    at::AutoDispatchBelowADInplaceOrView guard;
    return gemm_reduce_scatter_op().call(a, b, group_name, scatter_dim, bias, algorithm);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& a = saved[0];
    const at::Tensor& b = saved[1];
    const at::Tensor& grad_chunk = grads[0];
    at::Tensor grad_a, grad_b, grad_bias;
    // needs_input_grad counts tensor inputs only: a, b, then bias when given.
    const bool want_bias = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2);
    if (grad_chunk.defined() && (ctx->needs_input_grad(0) || ctx->needs_input_grad(1))) {
      const std::string group_name = ctx->saved_data["group_name"].toStringRef();
      const std::string algorithm = ctx->saved_data["algorithm"].toStringRef();
      auto [grad_a_full, grad_gathered] =
          allgather_gemm_op().call(grad_chunk, b.t(), group_name, ctx->saved_data["dim"].toInt(), std::nullopt,
                                   /*return_gathered=*/ctx->needs_input_grad(1), algorithm);
      if (ctx->needs_input_grad(0)) grad_a = grad_a_full;
      if (ctx->needs_input_grad(1)) grad_b = grad_of_b(b, rows_of(a), rows_of(*grad_gathered));
    }
    // The bias was added to this rank's chunk only.
    if (grad_chunk.defined() && want_bias) grad_bias = rows_of(grad_chunk).sum(0);
    return {grad_a, grad_b, at::Tensor(), at::Tensor(), grad_bias, at::Tensor()};
  }
};

class AllgatherGemmFunction : public torch::autograd::Function<AllgatherGemmFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b,
                               c10::string_view group_name, int64_t gather_dim, const std::optional<at::Tensor>& bias,
                               c10::string_view algorithm) {
    at::Tensor out, gathered;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      auto result = allgather_gemm_op().call(a, b, group_name, gather_dim, bias, /*return_gathered=*/true, algorithm);
      out = std::get<0>(result);
      gathered = *std::get<1>(result);
    }
    ctx->save_for_backward({gathered, b});
    ctx->mark_non_differentiable({gathered});
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["group_name"] = std::string(group_name);
    ctx->saved_data["dim"] = gather_dim;
    ctx->saved_data["algorithm"] = std::string(algorithm);
    return {out, gathered};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& gathered = saved[0];
    const at::Tensor& b = saved[1];
    const at::Tensor& grad_out = grads[0];
    at::Tensor grad_a, grad_b, grad_bias;
    if (grad_out.defined()) {
      if (ctx->needs_input_grad(0)) {
        grad_a = gemm_reduce_scatter_op().call(grad_out, b.t(), ctx->saved_data["group_name"].toStringRef(),
                                               ctx->saved_data["dim"].toInt(), std::nullopt,
                                               ctx->saved_data["algorithm"].toStringRef());
      }
      if (ctx->needs_input_grad(1)) grad_b = grad_of_b(b, rows_of(gathered), rows_of(grad_out));
      if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) grad_bias = rows_of(grad_out).sum(0);
    }
    return {grad_a, grad_b, at::Tensor(), at::Tensor(), grad_bias, at::Tensor()};
  }
};

at::Tensor gemm_reduce_scatter_autograd(const at::Tensor& a, const at::Tensor& b, c10::string_view group_name,
                                        int64_t scatter_dim, const std::optional<at::Tensor>& bias,
                                        c10::string_view algorithm) {
  return GemmReduceScatterFunction::apply(a, b, group_name, scatter_dim, bias, algorithm);
}

GatherResult allgather_gemm_autograd(const at::Tensor& a, const at::Tensor& b, c10::string_view group_name,
                                     int64_t gather_dim, const std::optional<at::Tensor>& bias, bool return_gathered,
                                     c10::string_view algorithm) {
  auto outputs = AllgatherGemmFunction::apply(a, b, group_name, gather_dim, bias, algorithm);
  return {outputs[0], return_gathered ? std::optional<at::Tensor>(outputs[1]) : std::nullopt};
}

}  // namespace
}  // namespace gemm_ar

TORCH_LIBRARY_IMPL(pto, Autograd, m) {
  m.impl("gemm_reduce_scatter", &gemm_ar::gemm_reduce_scatter_autograd);
  m.impl("allgather_gemm", &gemm_ar::allgather_gemm_autograd);
}
