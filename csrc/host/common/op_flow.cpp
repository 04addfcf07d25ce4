#include "common/op_flow.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <chrono>
#include <thread>

#include "common/auto_tuner.h"
#include "common/current_op.h"
#include "common/host_clock.h"
#include "common/portable_algorithms.h"
#include "common/quantization.h"
#include "common/rank_agreement.h"
#include "common/settings.h"
#include "common/test_hooks.h"

namespace gemm_ar {

c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(std::string_view group_name, std::string_view op_name) {
  try {
    return c10d::resolve_process_group(std::string(group_name));
  } catch (const std::exception&) {
    TORCH_CHECK_VALUE(false, op_name, ": group_name '", group_name,
                      "' is not a registered process group (pass ProcessGroup.group_name of a group created by "
                      "torch.distributed.init_process_group or new_group)");
  }
}

Algorithm choose_and_agree(CallArgs& call, c10d::ProcessGroup& group, const BackendHooks& backend,
                           const at::Device& device, const std::function<void(Algorithm)>& before_exchange) {
  // Asked on every rank, bad arguments or not: on CPU the first call on a group sets up its shared windows.
  std::string fused_reason = backend.fused_unavailable_reason(call, group);
  if (fused_reason.empty() && is_quantized(call)) {
    fused_reason = "quantized calls (W8A8, W8A16) have no fused path yet (docs/decisions/0020-quantized-ops.md)";
  }
  Algorithm chosen = call.algorithm;
  if (call.error.empty() && chosen == Algorithm::Fused) {
    if (!fused_reason.empty()) {  // raised after the agreement exchange, so that no peer waits for this rank
      call.error_code = kFusedUnavailableError;
      call.error = call.op_name + ": algorithm='fused' is not available for this call: " + fused_reason +
                   (call.op == kOpGemmAllreduce || call.op == kOpGemmAllreduceAddRmsnorm
                        ? " (use algorithm='auto', 'chunked' or 'sequential')"
                        : " (use algorithm='auto' or 'sequential')");
    }
  } else if (call.error.empty() && chosen == Algorithm::Auto) {
    chosen = backend.choose_auto(call, group, fused_reason.empty());
    if (backend.measured_auto && AutoTuner::enabled()) {
      const bool may_tune = !(backend.capturing && backend.capturing());
      // The backend's other ways to run the call fused (BackendHooks::fused_variants): candidates too. Asked only
      // when a bucket is met for the first time: working them out costs several call configurations.
      const auto variants = [&] {
        return fused_reason.empty() && backend.fused_variants ? backend.fused_variants(call, group)
                                                              : std::vector<Algorithm>{};
      };
      chosen = AutoTuner::instance().before_agreement(call, group, fused_reason.empty(), chosen, may_tune, variants);
    }
  }
  if (before_exchange) before_exchange(chosen);
  std::vector<CallSignature> all;
  try {
    all = backend.check_agreement ? backend.check_agreement(call, chosen, group)
                                  : check_ranks_agree(group, call, chosen, device);
  } catch (const c10::ValueError& e) {
    // Ranks that met this bucket a different number of times start tuning it again, together.
    if (call.tune_step >= 0 && std::string(e.what()).find(kTuneStepFieldName) != std::string::npos) {
      AutoTuner::instance().reset(call, group);
    }
    throw;
  }
  if (chosen == Algorithm::Auto) chosen = AutoTuner::instance().after_agreement(call, group, all);
  return chosen;
}

at::Tensor timed_for_tuner(const CallArgs& call, c10d::ProcessGroup& group, const BackendHooks& backend,
                           const std::function<at::Tensor()>& body) {
  if (call.tune_step < 0) return body();
  std::shared_ptr<DeviceClock> clock = backend.start_device_clock ? backend.start_device_clock() : nullptr;
  if (clock) {
    at::Tensor out = body();
    clock->stop();
    // Read at the bucket's next call, when the device has (almost always) run this one: no wait here.
    AutoTuner::instance().record_pending(call, group, [clock] { return clock->seconds(); });
    return out;
  }
  AutoTuner& tuner = AutoTuner::instance();
  if (const int64_t delay = test_hooks::tuner_start_delay_us(); delay > 0)
    std::this_thread::sleep_for(std::chrono::microseconds(delay));
  const int64_t start = monotonic_us();
  if (const int64_t slower = tuner.slowdown_us(call, group); slower > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(slower));
  }
  at::Tensor out = body();
  tuner.record(call, group, start, monotonic_us());
  return out;
}

at::Tensor run_gemm_allreduce(const at::Tensor& a, const at::Tensor& b, std::string_view group_name,
                              const std::optional<at::Tensor>& bias, std::string_view algorithm,
                              const BackendHooks& backend, const std::function<void(CallArgs&)>& extra_checks,
                              std::string_view op_name, const QuantInputs& quant) {
  auto group = resolve_group(group_name, op_name);
  CallArgs call = prepare_call(a, b, bias, algorithm, backend.device_type, backend.dtypes, "gemm_allreduce", quant);
  if (call.error.empty() && is_quantized(call) && !backend.quantized) {
    call.error_code = kQuantizedUnavailableError;
    call.error = call.op_name + ": quantized calls (int8 a or b, a_scale, b_scale, out_dtype) are not implemented on " +
                 a.device().str() + " yet (docs/ascend.md); the CPU backend runs them";
  }
  if (extra_checks && call.error.empty()) extra_checks(call);
  const CurrentOp op(call.op_name);  // errors deep in the engines name this op
  if (group->getSize() == 1) {
    TORCH_CHECK_NOT_IMPLEMENTED(call.error_code != kQuantizedUnavailableError, call.error);
    TORCH_CHECK_VALUE(call.error.empty(), call.error);
    return run_local(call);
  }
  // A small sequential call computes its partial product first, so that the agreement exchange sums it.
  AgreementPayload payload;
  const bool carries = !backend.agreement_carries_payload || backend.agreement_carries_payload(*group);
  const Algorithm chosen = choose_and_agree(call, *group, backend, a.device(), [&](Algorithm choice) {
    if (carries) carry_result_on_agreement(call, choice, group->getRank(), payload);
  });
  if (call.m == 0) return at::empty(call.out_shape, b.options().dtype(call.out_dtype));
  if (payload.reduced) return payload.data.to(call.out_dtype).view(call.out_shape);
  return timed_for_tuner(call, *group, backend, [&]() -> at::Tensor {
    switch (chosen) {
      case Algorithm::Sequential: return run_sequential(call, *group);
      case Algorithm::Chunked: return run_chunked(call, *group, chunk_count());
      case Algorithm::Fused:
      case Algorithm::FusedTiles:
      case Algorithm::FusedFewProducts:
      case Algorithm::FusedGatheredInputs:
        call.fused_family = fused_family_of(chosen);
        return backend.run_fused(call, *group);
      case Algorithm::Auto: break;
    }
    TORCH_CHECK(false, current_op(), ": internal error: no algorithm chosen");
  });
  TORCH_CHECK(false, current_op(), ": internal error: no algorithm chosen");
}

}  // namespace gemm_ar
