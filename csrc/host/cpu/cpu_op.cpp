// The CPU kernel of pto::gemm_allreduce: the shared op flow with the CPU fused engine and the CPU `auto` policy.
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/library.h>

#include <chrono>
#include <memory>

#include "common/current_op.h"
#include "common/op_flow.h"
#include "common/rank_agreement.h"
#include "common/test_hooks.h"
#include "cpu/auto_policy.h"
#include "cpu/call_geometry.h"
#include "cpu/cpu_backend.h"
#include "cpu/engine_options.h"
#include "cpu/fused_engine.h"
#include "cpu/gathered_inputs.h"

namespace gemm_ar::cpu {

// The engine of the call running on this thread (set by gemm_allreduce_cpu for the whole call): every hook of one
// call uses the same engine, even if the group is destroyed by another thread meanwhile.
thread_local FusedEngine* current_engine = nullptr;

FusedEngine& engine_of_this_call(c10d::ProcessGroup& group) {
  TORCH_CHECK(current_engine != nullptr, current_op(), ": internal error: no engine for group '", group.getGroupName(),
              "' on this thread");
  return *current_engine;
}

namespace {

// The test hook deferred_tuner_clock: the NPU's deferred tuning clock, run on the host for the tests.
class DeferredHostClock final : public DeviceClock {
 public:
  explicit DeferredHostClock(bool fails) : fails_(fails), start_(std::chrono::steady_clock::now()) {}
  void stop() override { stop_ = std::chrono::steady_clock::now(); }
  double seconds() override {
    TORCH_CHECK(!fails_,
                "the call's kernels did not finish (a deliberate failure: the test hook deferred_tuner_clock=2)");
    return std::chrono::duration<double>(stop_ - start_).count();
  }

 private:
  bool fails_;
  std::chrono::steady_clock::time_point start_, stop_;
};

std::unique_ptr<DeviceClock> start_deferred_host_clock() {
  const int64_t mode = test_hooks::deferred_tuner_clock();
  if (mode == 0) return nullptr;  // the host's own timing
  return std::make_unique<DeferredHostClock>(mode == 2);
}

BackendHooks make_cpu_backend() {
  BackendHooks hooks{
      c10::DeviceType::CPU,
      {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble},
      [](const CallArgs&, c10d::ProcessGroup& group) { return engine_of_this_call(group).unavailable_reason(); },
      [](const CallArgs& call, c10d::ProcessGroup& group) { return engine_of_this_call(group).run(call); },
      [](const CallArgs& call, c10d::ProcessGroup& group, bool fused_available) {
        return choose_cpu_algorithm(call, group.getSize(), fused_available);
      },
      [](const CallArgs& call, Algorithm chosen, c10d::ProcessGroup& group) {
        FusedEngine& engine = engine_of_this_call(group);
        if (engine.has_windows()) return engine.agree(call, chosen);
        return check_ranks_agree(group, call, chosen, call.b.defined() ? call.b.device() : at::Device(at::kCPU));
      },
      /*measured_auto=*/true,
  };
  hooks.quantized = true;
  hooks.start_device_clock = &start_deferred_host_clock;
  // The engine agrees through its windows, which carry no data: a small sequential call then computes once, after.
  hooks.agreement_carries_payload = [](c10d::ProcessGroup& group) { return !engine_of_this_call(group).has_windows(); };
  // `auto` also times fused with the tile family the geometry rules did not pick (measured on one CPU only), and the
  // gathered-inputs flow where the inputs are small against the output. Asked for the bucket's largest M (M rounded
  // up to a power of two, as the tuner's buckets are), so that a bucket has the same candidates whichever of its
  // calls meets it first (a cached decision must be one of them).
  hooks.fused_variants = [](const CallArgs& call, c10d::ProcessGroup& group) {
    std::vector<Algorithm> variants;
    if (call.op != kOpGemmAllreduce) return variants;
    int64_t bucket_m = 1;
    while (bucket_m < call.m) bucket_m <<= 1;
    const int world = static_cast<int>(group.getSize());
    if (option(engine_options().tune_tile_family)) {
      const Algorithm other = other_tile_family(bucket_m, call.k, call.n, call.dtype, world);
      if (other != Algorithm::Auto) variants.push_back(other);
    }
    if (option(engine_options().tune_gathered_inputs) &&
        suits_gathered_inputs(bucket_m, call.k, call.n, call.dtype, world)) {
      variants.push_back(Algorithm::FusedGatheredInputs);
    }
    return variants;
  };
  return hooks;
}

}  // namespace

const BackendHooks& cpu_backend() {
  static const BackendHooks hooks = make_cpu_backend();
  return hooks;
}

void with_call_engine(std::string_view op_name, std::string_view name, const std::function<void()>& body) {
  const std::string op(op_name);
  const CurrentOp naming(op);  // the engine's setup below names the op too
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  try {
    group = c10d::resolve_process_group(std::string(name));
  } catch (const std::exception&) {
    return body();  // raises the op's own error for an unknown group
  }
  if (group->getSize() == 1) return body();
  // One call at a time per group (docs/usage.md, "Threads, group lifetime, fork"); the engine is set up
  // (collectively) before waiting here, as every rank's first call does.
  std::shared_ptr<FusedEngine> engine = FusedEngine::of(*group);
  std::lock_guard<std::mutex> one_call_at_a_time(engine->call_mutex());
  struct CurrentEngine {
    explicit CurrentEngine(FusedEngine* e) { current_engine = e; }
    ~CurrentEngine() { current_engine = nullptr; }
  } current(engine.get());
  body();
}

namespace {

at::Tensor gemm_allreduce_cpu(const at::Tensor& a, const at::Tensor& b, c10::string_view group_name,
                              const std::optional<at::Tensor>& bias, c10::string_view algorithm,
                              const std::optional<at::Tensor>& a_scale, const std::optional<at::Tensor>& b_scale,
                              std::optional<at::ScalarType> out_dtype) {
  const std::string_view name(group_name.data(), group_name.size());
  at::Tensor out;
  with_call_engine("gemm_allreduce", name, [&] {
    out = run_gemm_allreduce(a, b, name, bias, std::string_view(algorithm.data(), algorithm.size()), cpu_backend(), {},
                             "gemm_allreduce", QuantInputs{a_scale, b_scale, out_dtype});
  });
  return out;
}

}  // namespace
}  // namespace gemm_ar::cpu

TORCH_LIBRARY_IMPL(pto, CPU, m) { m.impl("gemm_allreduce", &gemm_ar::cpu::gemm_allreduce_cpu); }
