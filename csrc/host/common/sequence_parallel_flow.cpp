#include "common/sequence_parallel_flow.h"

#include "common/current_op.h"
#include "common/local_gemm.h"
#include "common/portable_algorithms.h"
#include "common/shard_collectives.h"

namespace gemm_ar {
namespace {

constexpr const char* kReduceScatterName = "gemm_reduce_scatter";
constexpr const char* kAllgatherName = "allgather_gemm";

void set_error(CallArgs& call, int64_t code, const std::string& message) {
  call.error_code = code;
  call.error = call.op_name + ": " + message;
}

// The sharded dim must be a row dim of `a` (not K): these ops shard the sequence/tokens, and each one's backward is
// the other op along the same dim. Records the normalised dim, or this rank's error.
void check_shard_dim(CallArgs& call, const at::Tensor& a, const char* arg_name, int64_t dim) {
  if (!call.error.empty()) return;
  const int64_t rows_dims = a.dim() - 1;
  const int64_t normalised = dim < 0 ? dim + a.dim() : dim;
  if (normalised < 0 || normalised >= rows_dims) {
    set_error(call, kBadShardDimError,
              std::string(arg_name) + "=" + std::to_string(dim) + " must name a row dim of a " +
                  std::to_string(a.dim()) + "-D input (0.." + std::to_string(rows_dims - 1) +
                  " or its negative form); the last dim K/N cannot be sharded");
    return;
  }
  call.shard_dim = normalised;
}

// `chunked` has no sequence-parallel variant yet: a clear local error, raised on every rank after agreement.
void reject_chunked(CallArgs& call) {
  if (call.error.empty() && call.algorithm == Algorithm::Chunked) {
    set_error(call, kAlgorithmUnavailableError,
              "algorithm='chunked' is not available for this op (use algorithm='auto' or 'sequential')");
  }
}

// The agreed algorithm must be one this op has on this backend (`fused` is only agreed where it is available).
// A fused call with no rows runs the sequential code, which handles empty tensors.
void check_implemented(const CallArgs& call, Algorithm chosen, bool has_fused) {
  TORCH_CHECK(chosen == Algorithm::Sequential || (chosen == Algorithm::Fused && has_fused), call.op_name,
              ": internal error: algorithm ", algorithm_name(chosen), " has no implementation for this op");
}

at::Tensor local_product(const at::Tensor& a2d, const CallArgs& call, bool add_bias) {
  LocalGemm gemm(a2d, call.b, call.bias, add_bias);
  auto out = at::empty({a2d.size(0), call.n}, call.b.options());
  if (out.numel() > 0) gemm.compute(0, a2d.size(0), 0, call.n, out);
  return out;
}

}  // namespace

at::Tensor run_gemm_reduce_scatter(const at::Tensor& a, const at::Tensor& b, std::string_view group_name,
                                   int64_t scatter_dim, const std::optional<at::Tensor>& bias,
                                   std::string_view algorithm, const BackendHooks& backend) {
  auto group = resolve_group(group_name, kReduceScatterName);
  const int64_t world = group->getSize();
  CallArgs call = prepare_call(a, b, bias, algorithm, backend.device_type, backend.dtypes, kReduceScatterName);
  const CurrentOp op(call.op_name);  // errors deep in the engines name this op
  call.op = kOpGemmReduceScatter;
  check_shard_dim(call, a, "scatter_dim", scatter_dim);
  if (call.error.empty() && call.out_shape[call.shard_dim] % world != 0) {
    set_error(call, kNotDivisibleError,
              "the output's size along scatter_dim=" + std::to_string(scatter_dim) + " is " +
                  std::to_string(call.out_shape[call.shard_dim]) + ", not divisible by the world size " +
                  std::to_string(world) + " of group '" + std::string(group_name) + "'");
  }
  reject_chunked(call);
  if (world == 1) {
    TORCH_CHECK_VALUE(call.error.empty(), call.error);
    return run_local(call);
  }
  const Algorithm chosen = choose_and_agree(call, *group, backend, a.device());
  check_implemented(call, chosen, backend.run_fused_reduce_scatter != nullptr);
  return timed_for_tuner(call, *group, backend, [&] {
    if (chosen == Algorithm::Fused && call.m > 0) return backend.run_fused_reduce_scatter(call, *group);
    // Rank 0 adds the bias to its partial product, so the reduced sum holds it once in every chunk.
    auto partial = local_product(call.a2d, call, /*add_bias=*/group->getRank() == 0).view(call.out_shape);
    return reduce_scatter_along(partial, call.shard_dim, *group);
  });
}

std::tuple<at::Tensor, std::optional<at::Tensor>> run_allgather_gemm(const at::Tensor& a, const at::Tensor& b,
                                                                     std::string_view group_name, int64_t gather_dim,
                                                                     const std::optional<at::Tensor>& bias,
                                                                     bool return_gathered, std::string_view algorithm,
                                                                     const BackendHooks& backend) {
  auto group = resolve_group(group_name, kAllgatherName);
  CallArgs call = prepare_call(a, b, bias, algorithm, backend.device_type, backend.dtypes, kAllgatherName);
  const CurrentOp op(call.op_name);  // errors deep in the engines name this op
  call.op = kOpAllgatherGemm;
  check_shard_dim(call, a, "gather_dim", gather_dim);
  reject_chunked(call);
  auto with_gathered = [&](at::Tensor out, const at::Tensor& gathered) {
    return std::make_tuple(std::move(out), return_gathered ? std::optional<at::Tensor>(gathered) : std::nullopt);
  };
  if (group->getSize() == 1) {
    TORCH_CHECK_VALUE(call.error.empty(), call.error);
    return with_gathered(run_local(call), a.clone());  // a fresh tensor: op outputs never alias inputs
  }
  const Algorithm chosen = choose_and_agree(call, *group, backend, a.device());
  check_implemented(call, chosen, backend.run_fused_allgather != nullptr);
  at::Tensor gathered;
  auto out = timed_for_tuner(call, *group, backend, [&] {
    if (chosen == Algorithm::Fused && call.m > 0) {
      auto [result, all_rows] = backend.run_fused_allgather(call, *group);
      gathered = std::move(all_rows);
      return result;
    }
    gathered = all_gather_along(a, call.shard_dim, *group);
    std::vector<int64_t> out_shape(gathered.sizes().begin(), gathered.sizes().end() - 1);
    out_shape.push_back(call.n);
    const int64_t rows = c10::multiply_integers(out_shape.begin(), out_shape.end() - 1);
    return local_product(gathered.reshape({rows, call.k}), call, /*add_bias=*/true).view(out_shape);
  });
  return with_gathered(out, gathered);
}

}  // namespace gemm_ar
