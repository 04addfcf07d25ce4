// The steps every device backend of the op shares: resolve the group, check the arguments on every rank,
// choose the algorithm, run it. A backend contributes its dtypes, its fused path and its `auto` policy.
#pragma once
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <functional>
#include <memory>
#include <string>
#include <tuple>

#include "common/call_args.h"
#include "common/rank_agreement.h"

namespace gemm_ar {

// A tuning call's clock on the device, for backends whose calls return before the device has run them (NPU: timing
// events on the caller's stream). Started before the call's work is queued, stopped after it; seconds() is asked at
// the bucket's next call and may wait for the device, bounded by TORCH_GEMM_AR_TIMEOUT_S (then it raises).
class DeviceClock {
 public:
  virtual ~DeviceClock() = default;
  virtual void stop() = 0;
  virtual double seconds() = 0;
};

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
  // Starts a DeviceClock on the current stream; empty: tuning calls are timed on the host (the CPU backends, whose
  // calls have finished when they return).
  std::function<std::unique_ptr<DeviceClock>()> start_device_clock;
  // True while the current stream is being captured into a graph: no tuning then (a captured tuning step would be
  // replayed forever); the decision already made, else choose_auto's. Empty: never capturing.
  std::function<bool()> capturing;
  // `fused` of the sequence-parallel ops (common/sequence_parallel_flow.h), where the backend has it: the rank's
  // chunk of the reduce-scatter; the product and the gathered a of the allgather.
  std::function<at::Tensor(const CallArgs&, c10d::ProcessGroup&)> run_fused_reduce_scatter;
  std::function<std::tuple<at::Tensor, at::Tensor>(const CallArgs&, c10d::ProcessGroup&)> run_fused_allgather;
  // Whether check_agreement's exchange can carry a small sequential call's result (AgreementPayload): only then is
  // the partial product computed before it (else it would be computed twice). Empty: check_ranks_agree, which can.
  std::function<bool(c10d::ProcessGroup&)> agreement_carries_payload;
  // The backend's other ways to run this call fused that `auto` races too: FusedTiles or FusedFewProducts (the tile
  // family the geometry rules did not pick, where it is a different configuration worth timing) and
  // FusedGatheredInputs (where the inputs are small against the output). Empty list or function: none.
  std::function<std::vector<Algorithm>(const CallArgs&, c10d::ProcessGroup&)> fused_variants;
  // Whether the backend computes quantized calls (common/quantization.h; `sequential` and `chunked`). Otherwise
  // they raise NotImplementedError on every rank.
  bool quantized = false;
};

c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(std::string_view group_name,
                                                     std::string_view op_name = "gemm_allreduce");

// The middle of every op's flow on a group of two or more ranks: resolves `auto`, turns an unavailable `fused` into
// this rank's error, and makes every rank agree (each raises the same error otherwise). Returns what to run.
// `before_exchange` (may be empty) sees the chosen algorithm just before the agreement exchange.
Algorithm choose_and_agree(CallArgs& call, c10d::ProcessGroup& group, const BackendHooks& backend,
                           const at::Device& device, const std::function<void(Algorithm)>& before_exchange = {});

// Runs `body` (the chosen algorithm of a call on a group of two or more ranks); a tuning call's time on this rank
// (on the host, or the backend's DeviceClock) goes to the `auto` tuner (the next call tells the other ranks).
at::Tensor timed_for_tuner(const CallArgs& call, c10d::ProcessGroup& group, const BackendHooks& backend,
                           const std::function<at::Tensor()>& body);

// `extra_checks` (may be empty) validates a fused epilogue's own arguments: it runs only when `a`, `b` and `bias`
// are valid and reports problems in call.error/error_code, so they reach every rank through the agreement.
// `op_name` names the op in the errors raised before extra_checks runs (an unknown group). `quant`: the quantized
// call's scales and out_dtype (common/quantization.h).
at::Tensor run_gemm_allreduce(const at::Tensor& a, const at::Tensor& b, std::string_view group_name,
                              const std::optional<at::Tensor>& bias, std::string_view algorithm,
                              const BackendHooks& backend, const std::function<void(CallArgs&)>& extra_checks = {},
                              std::string_view op_name = "gemm_allreduce", const QuantInputs& quant = {});

}  // namespace gemm_ar
