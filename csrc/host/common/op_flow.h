// The steps every device backend of the op shares: resolve the group, check the arguments on every rank,
// choose the algorithm, run it. A backend contributes its dtypes, its fused path and its `auto` policy.
#pragma once
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <functional>
#include <string>
#include <tuple>

#include "common/call_args.h"
#include "common/rank_agreement.h"

namespace gemm_ar {

struct BackendHooks {
  c10::DeviceType device_type;
  std::vector<at::ScalarType> dtypes;
  // Empty when `fused` can run this call on this group; otherwise what is missing.
  std::function<std::string(const CallArgs&, c10d::ProcessGroup&)> fused_unavailable_reason;
  std::function<at::Tensor(const CallArgs&, c10d::ProcessGroup&)> run_fused;
  // Picks sequential, chunked or fused for `algorithm="auto"`; must give the same answer on every rank.
  std::function<Algorithm(const CallArgs&, c10d::ProcessGroup&, bool fused_available)> choose_auto;
  // Makes every rank raise the same error when any rank's arguments are bad or the ranks disagree, and returns
  // every rank's signature (empty when a fused run checks them itself, later). Empty: the signature exchange over
  // the process group (check_ranks_agree).
  std::function<std::vector<CallSignature>(const CallArgs&, Algorithm chosen, c10d::ProcessGroup&)> check_agreement;
  // `auto` decided by measurement (common/auto_tuner.h) where TORCH_GEMM_AR_AUTOTUNE allows; choose_auto then
  // only gives the choice while tracing-free fallbacks apply.
  bool measured_auto = false;
  // `fused` of the sequence-parallel ops (common/sequence_parallel_flow.h), where the backend has it: the rank's
  // chunk of the reduce-scatter; the product and the gathered a of the allgather.
  std::function<at::Tensor(const CallArgs&, c10d::ProcessGroup&)> run_fused_reduce_scatter;
  std::function<std::tuple<at::Tensor, at::Tensor>(const CallArgs&, c10d::ProcessGroup&)> run_fused_allgather;
};

c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(std::string_view group_name,
                                                     std::string_view op_name = "gemm_allreduce");

// The middle of every op's flow on a group of two or more ranks: resolves `auto`, turns an unavailable `fused` into
// this rank's error, and makes every rank agree (each raises the same error otherwise). Returns what to run.
// `before_exchange` (may be empty) sees the chosen algorithm just before the agreement exchange.
Algorithm choose_and_agree(CallArgs& call, c10d::ProcessGroup& group, const BackendHooks& backend,
                           const at::Device& device, const std::function<void(Algorithm)>& before_exchange = {});

// `extra_checks` (may be empty) validates a fused epilogue's own arguments: it runs only when `a`, `b` and `bias`
// are valid and reports problems in call.error/error_code, so they reach every rank through the agreement.
at::Tensor run_gemm_allreduce(const at::Tensor& a, const at::Tensor& b, std::string_view group_name,
                              const std::optional<at::Tensor>& bias, std::string_view algorithm,
                              const BackendHooks& backend,
                              const std::function<void(CallArgs&)>& extra_checks = {});

}  // namespace gemm_ar
