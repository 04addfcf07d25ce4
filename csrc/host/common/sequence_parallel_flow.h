// The device-independent flow of the sequence-parallel ops (pto::gemm_reduce_scatter, pto::allgather_gemm):
// the gemm_allreduce argument checks plus the scatter/gather dim, the same agreement exchange, then the algorithm.
// `fused` runs the backend's run_fused_reduce_scatter / run_fused_allgather; `auto` resolves through the backend
// hooks (and the measured tuner where the backend uses it).
#pragma once
#include <optional>
#include <string_view>
#include <tuple>

#include "common/op_flow.h"

namespace gemm_ar {

// reduce_scatter_sum(a @ b (+ bias once)) along `scatter_dim` of the output; rank r gets chunk r.
at::Tensor run_gemm_reduce_scatter(const at::Tensor& a, const at::Tensor& b, std::string_view group_name,
                                   int64_t scatter_dim, const std::optional<at::Tensor>& bias,
                                   std::string_view algorithm, const BackendHooks& backend);

// (all_gather(a, gather_dim) @ b (+ bias), the gathered a when `return_gathered`).
std::tuple<at::Tensor, std::optional<at::Tensor>> run_allgather_gemm(const at::Tensor& a, const at::Tensor& b,
                                                                     std::string_view group_name, int64_t gather_dim,
                                                                     const std::optional<at::Tensor>& bias,
                                                                     bool return_gathered, std::string_view algorithm,
                                                                     const BackendHooks& backend);

}  // namespace gemm_ar
