// torch_gemm_ar._C: loading it registers the op (static initialisers of ops.cpp and the device kernels).
#include <torch/extension.h>

#include "common/auto_tuner.h"
#include "common/local_gemm.h"
#include "common/settings.h"
#include "common/test_hooks.h"
#include "cpu/engine_options.h"
#include "cpu/engine_tile_walk.h"
#include "cpu/shared_outputs.h"
#include "op_table.h"

#ifdef TORCH_GEMM_AR_TEST_HOOKS
namespace gemm_ar::test_hooks {
void bind(pybind11::module_& m);
}  // namespace gemm_ar::test_hooks
#endif

namespace {

// _engine_options() -> {name: value}; _set_engine_option(name, value) -> the old value. One pair for every option of
// cpu/engine_options.h (torch_gemm_ar.engine_options wraps them).
void bind_engine_options(pybind11::module_& m) {
  m.def(
      "_engine_options",
      [] {
        pybind11::dict out;
        const auto& o = gemm_ar::cpu::engine_options();
#define GEMM_AR_ENGINE_OPTION_READ(type, name, initial, largest, what) out[#name] = gemm_ar::cpu::option(o.name);
        GEMM_AR_ENGINE_OPTION_LIST(GEMM_AR_ENGINE_OPTION_READ)
#undef GEMM_AR_ENGINE_OPTION_READ
        return out;
      },
      "CPU engine: every option (cpu/engine_options.h) and its value in this process");
  m.def(
      "_set_engine_option",
      [](const std::string& name, pybind11::object value) -> pybind11::object {
        auto& o = gemm_ar::cpu::engine_options();
#define GEMM_AR_ENGINE_OPTION_SET(type, name_, initial, largest, what)                                             \
  if (name == #name_) {                                                                                            \
    const type v = value.cast<type>();                                                                             \
    const auto as_int = static_cast<int64_t>(v);                                                                   \
    TORCH_CHECK_VALUE(as_int >= 0 && as_int <= (largest), "engine option '", name, "' must be in [0, ", (largest), \
                      "]; got ", as_int);                                                                          \
    return pybind11::cast(o.name_.exchange(v, std::memory_order_relaxed));                                         \
  }
        GEMM_AR_ENGINE_OPTION_LIST(GEMM_AR_ENGINE_OPTION_SET)
#undef GEMM_AR_ENGINE_OPTION_SET
        std::string known;
#define GEMM_AR_ENGINE_OPTION_NAME(type, name_, initial, largest, what) \
  known += std::string(known.empty() ? "" : ", ") + #name_;
        GEMM_AR_ENGINE_OPTION_LIST(GEMM_AR_ENGINE_OPTION_NAME)
#undef GEMM_AR_ENGINE_OPTION_NAME
        TORCH_CHECK_VALUE(false, "unknown engine option '", name, "'; the options are: ", known);
      },
      pybind11::arg("name"), pybind11::arg("value"),
      "CPU engine: sets one option (process-wide, from the next call; set it alike on every rank: ranks that differ "
      "get an error naming the engine's options) and returns its old value");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch-gemm-ar native extension: pto::gemm_allreduce and its engines";
  bind_engine_options(m);
  m.def(
      "_op_table",
      [] {
        pybind11::list out;
        for (const auto& op : gemm_ar::kOps) {
          out.append(pybind11::dict(pybind11::arg("name") = op.name, pybind11::arg("schema") = op.schema,
                                    pybind11::arg("kind") = static_cast<int>(op.kind)));
        }
        return out;
      },
      "the op family (op_table.h): name, schema, OpKind");
  m.def(
      "_settings",
      [] {
        pybind11::list out;
        for (int i = 0; i < gemm_ar::setting_count(); ++i) {
          const auto& s = gemm_ar::setting_info_at(i);
          out.append(pybind11::dict(pybind11::arg("variable") = s.variable, pybind11::arg("default") = s.initial,
                                    pybind11::arg("read") = s.when, pybind11::arg("meaning") = s.what));
        }
        return out;
      },
      "every TORCH_GEMM_AR_* run-time setting the library reads (common/settings.h): variable, default, when read");
#ifdef TORCH_GEMM_AR_TEST_HOOKS
  gemm_ar::test_hooks::bind(m);
#endif
  m.attr("_test_build") = gemm_ar::test_hooks::kEnabled;
  m.def("_set_shared_output_slots", &gemm_ar::cpu::set_shared_output_slots, pybind11::arg("slots"),
        "CPU engine: output slots per window from the next call (TORCH_GEMM_AR_SHARED_OUTPUTS; 0: every output "
        "private). Set it alike on every rank (ranks that differ get an error naming the engine's options); returns "
        "the old value");
  m.def("_shared_output_slots", &gemm_ar::cpu::shared_output_slots,
        "CPU fused engine: output slots per window from the next call (TORCH_GEMM_AR_SHARED_OUTPUTS)");
  m.def("_engine_tile_walk", &gemm_ar::cpu::engine_tile_walk, pybind11::arg("a"), pybind11::arg("b"),
        pybind11::arg("bias") = std::nullopt, pybind11::arg("world") = 1,
        "CPU fused engine: a @ b (+ bias) multiplied as a gemm_allreduce call on `world` local ranks multiplies it "
        "(its tiles, packed B panels), without communication (benchmarks)");
  m.def(
      "_computes_in_fp32", [](const at::Tensor& t) { return gemm_ar::computes_in_fp32(t); },
      "whether this CPU computes GEMMs of t's dtype in fp32 (no half-precision matrix instructions)");
  auto& tuner = gemm_ar::AutoTuner::instance();
  m.def(
      "_tuner_decisions",
      [&tuner] {
        pybind11::list out;
        for (const auto& d : tuner.decisions()) {
          pybind11::dict times, runs, relative;
          for (const auto& [name, us] : d.candidate_us) times[pybind11::str(name)] = us;
          for (const auto& [name, count] : d.candidate_runs) runs[pybind11::str(name)] = count;
          for (const auto& [name, ratio] : d.candidate_relative) relative[pybind11::str(name)] = ratio;
          out.append(pybind11::dict(pybind11::arg("group") = d.group, pybind11::arg("bucket") = d.bucket,
                                    pybind11::arg("algorithm") = d.algorithm, pybind11::arg("source") = d.source,
                                    pybind11::arg("candidate_us") = times, pybind11::arg("candidate_runs") = runs,
                                    pybind11::arg("candidate_relative") = relative));
        }
        return out;
      },
      "auto tuner: every decision of this process, in order");
  m.def(
      "_tuner_decision_for",
      [&tuner](const std::string& group_name, int64_t world, int64_t m, int64_t k, int64_t n, at::ScalarType dtype,
               bool bias, const std::string& device) {
        return tuner.decision_for(group_name, world, m, k, n, dtype, bias, c10::Device(device).type());
      },
      "auto tuner: the algorithm decided for a gemm_allreduce call of that shape on the group (\"\": none yet)");
  m.def("_tuner_cache_path", [&tuner] { return tuner.cache_path(); });
  m.def(
      "_tuner_in_progress", [&tuner](const std::string& group_name) { return tuner.in_progress(group_name); },
      "auto tuner: whether a shape bucket of the group (\"\": any group) is being tuned");
  m.def(
      "_set_tuner_logger",
      [&tuner](pybind11::object fn) {
        // Kept alive for the process (never released: decisions may be logged during interpreter shutdown).
        auto* callback = new pybind11::object(std::move(fn));
        tuner.set_logger([callback](const std::string& message) {
          pybind11::gil_scoped_acquire gil;
          try {
            (*callback)(message);
          } catch (const pybind11::error_already_set&) {
            // A failing logger must not fail the collective call.
          }
        });
      },
      "auto tuner: fn(message) is called with each decision (torch_gemm_ar logs it)");
}
