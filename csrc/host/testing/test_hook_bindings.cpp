// The test build's Python face of its hooks (common/test_hooks.h): _C._test_hooks() -> {name: value},
// _C._set_test_hook(name, value) -> the old value, and _C._set_tuner_slow_candidate(algorithm, us).
#include <torch/extension.h>

#include "common/algorithm.h"
#include "common/auto_tuner.h"
#include "common/test_hooks.h"

#ifndef TORCH_GEMM_AR_TEST_HOOKS
#error "csrc/host/testing is compiled only into the test build (TORCH_GEMM_AR_TEST_HOOKS)"
#endif

namespace gemm_ar::test_hooks {

void bind(pybind11::module_& m) {
  m.def(
      "_test_hooks",
      [] {
        pybind11::dict out;
#define GEMM_AR_TEST_HOOK_READ(type, name, harmless, what) out[#name] = name();
        GEMM_AR_TEST_HOOK_LIST(GEMM_AR_TEST_HOOK_READ)
#undef GEMM_AR_TEST_HOOK_READ
        return out;
      },
      "test build: every hook and its value in this process");
  m.def(
      "_set_test_hook",
      [](const std::string& name, pybind11::object value) -> pybind11::object {
#define GEMM_AR_TEST_HOOK_SET(type, name_, harmless, what) \
  if (name == #name_) return pybind11::cast(hooks().name_.exchange(value.cast<type>(), std::memory_order_relaxed));
        GEMM_AR_TEST_HOOK_LIST(GEMM_AR_TEST_HOOK_SET)
#undef GEMM_AR_TEST_HOOK_SET
        TORCH_CHECK_VALUE(false, "unknown test hook '", name, "' (common/test_hooks.h)");
      },
      pybind11::arg("name"), pybind11::arg("value"), "test build: sets one hook; returns its old value");
  m.def(
      "_set_tuner_slow_candidate",
      [](const std::string& algorithm, int64_t us) {
        const bool all_but = !algorithm.empty() && algorithm[0] == '!';
        const auto parsed = parse_tuned_algorithm(all_but ? algorithm.substr(1) : algorithm);
        TORCH_CHECK_VALUE(parsed.has_value() || (!all_but && (algorithm.empty() || algorithm == "*")),
                          "unknown algorithm '", algorithm, "'");
        const int64_t code = !parsed.has_value() ? (algorithm == "*" ? AutoTuner::kEveryCandidate : -1)
                             : all_but           ? AutoTuner::kAllBut - static_cast<int64_t>(*parsed)
                                                 : static_cast<int64_t>(*parsed);
        hooks().tuner_slow_us.store(us, std::memory_order_relaxed);
        hooks().tuner_slow_candidate.store(code, std::memory_order_relaxed);
      },
      pybind11::arg("algorithm"), pybind11::arg("us"),
      "test build: every tuning run of `algorithm` (\"*\": of every candidate; \"!name\": of every candidate but that "
      "one) takes `us` longer (\"\": none)");
}

}  // namespace gemm_ar::test_hooks
