// gemm_ar_engine_observation: what the tests observe of the CPU engine (its geometry rules, data-flow plan, call
// counters, the owner's reduction on tensors, the tuner's decision rule), bound to Python outside the product
// (docs/decisions/0015-test-hooks.md). Built by tests/engine_observation_build.py without linking torch_gemm_ar._C:
// its undefined symbols resolve against whichever _C the process loaded (the product or the test build), made
// global before this module loads, so the counters read are that library's own.
#include <torch/extension.h>

#include "common/auto_tuner.h"
#include "common/local_gemm.h"
#include "common/portable_algorithms.h"
#include "common/quantization.h"
#include "common/rank_agreement.h"
#include "common/tuning_race.h"
#include "cpu/call_geometry.h"
#include "cpu/call_plan.h"
#include "cpu/engine_config.h"
#include "cpu/fused_call.h"
#include "cpu/fused_engine.h"
#include "cpu/gathered_inputs.h"
#include "cpu/packed_b_panels.h"
#include "cpu/reduce_avx512.h"
#include "cpu/shared_outputs.h"
#include "cpu/tile_kernels.h"

namespace {

using GeometryRule = gemm_ar::cpu::EngineConfig (*)(const gemm_ar::cpu::EngineConfig&, int64_t, int64_t, int);

// A per-call geometry rule of the CPU engine as the tests see it: (tile rows, tile columns, stripe rows) of an
// M x N call on `world` local ranks, under this process's engine settings.
auto geometry_of(GeometryRule rule) {
  return [rule](int64_t m, int64_t n, int world) {
    const auto c = rule(gemm_ar::cpu::engine_config(world), m, n, world);
    return pybind11::make_tuple(c.base_m, c.base_n, c.sub_m);
  };
}

// The CPU engine's configuration for a call of `op` ('gemm_allreduce' or 'add_rmsnorm') as the tests see it;
// `binding` names the caller in the error.
gemm_ar::cpu::EngineConfig config_of_call(const char* binding, const std::string& op, int64_t m, int64_t k, int64_t n,
                                          const at::Tensor& like, int world) {
  TORCH_CHECK_VALUE(op == "gemm_allreduce" || op == "add_rmsnorm" || op == "gemm_reduce_scatter" ||
                        op == "allgather_gemm",
                    binding,
                    ": op must be 'gemm_allreduce', 'add_rmsnorm', 'gemm_reduce_scatter' or 'allgather_gemm'; "
                    "got '",
                    op, "'");
  TORCH_CHECK_VALUE(world > 0, binding, ": world must be positive; got ", world);
  if (op == "gemm_reduce_scatter" || op == "allgather_gemm") {
    // A 2-D call whose whole M (allgather_gemm: gathered) is m: every rank's chunk holds m / world rows.
    TORCH_CHECK_VALUE(m % world == 0, binding, ": m must be a multiple of world for '", op, "'; got m=", m);
    const bool gather = op == "allgather_gemm";
    return gemm_ar::cpu::call_config(gather ? gemm_ar::kOpAllgatherGemm : gemm_ar::kOpGemmReduceScatter,
                                     gather ? m / world : m, k, n, like.scalar_type(), world, 0, m / world);
  }
  const int64_t kind = op == "add_rmsnorm" ? gemm_ar::kOpGemmAllreduceAddRmsnorm : gemm_ar::kOpGemmAllreduce;
  return gemm_ar::cpu::call_config(kind, m, k, n, like.scalar_type(), world);
}

// The owner's reduction (cpu/tile_kernels.h) on tensors, through the AVX-512 loop or the portable one (tests):
// out (and bank) = the sum of `partials` in list order; with add_into_out, out holds an addend.
void reduce_rows_for_test(const std::vector<at::Tensor>& partials, at::Tensor& out, std::optional<at::Tensor> bank,
                          bool add_into_out, bool avx512) {
  TORCH_CHECK_VALUE(!partials.empty(), "reduce_rows: partials must not be empty");
  const auto& first = partials[0];
  std::vector<const uint8_t*> sources;
  for (const auto& p : partials) {
    TORCH_CHECK_VALUE(p.dim() == 2 && p.sizes() == first.sizes() && p.strides() == first.strides() &&
                          p.stride(1) == 1 && p.scalar_type() == first.scalar_type() && p.device().is_cpu(),
                      "reduce_rows: partials must be CPU [rows, cols] tensors of one shape, dtype and row stride");
    sources.push_back(static_cast<const uint8_t*>(p.data_ptr()));
  }
  auto check_out = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.dim() == 2 && t.sizes() == first.sizes() && t.stride(1) == 1 &&
                          t.scalar_type() == out.scalar_type() && t.device().is_cpu(),
                      "reduce_rows: ", name, " must be a CPU tensor shaped like the partials, in out's dtype");
  };
  check_out(out, "out");
  if (bank) check_out(*bank, "bank");
  gemm_ar::cpu::ReduceRows job{sources.data(),
                               static_cast<int>(sources.size()),
                               first.stride(0),
                               first.scalar_type(),
                               bank ? static_cast<uint8_t*>(bank->data_ptr()) : nullptr,
                               bank ? bank->stride(0) : 0,
                               static_cast<uint8_t*>(out.data_ptr()),
                               out.stride(0),
                               out.scalar_type(),
                               first.size(0),
                               first.size(1),
                               add_into_out};
  const bool previous = gemm_ar::cpu::set_avx512_reduce(avx512);
  try {
    gemm_ar::cpu::reduce_rows(job);
  } catch (...) {
    gemm_ar::cpu::set_avx512_reduce(previous);
    throw;
  }
  gemm_ar::cpu::set_avx512_reduce(previous);
}

}  // namespace

PYBIND11_MODULE(gemm_ar_engine_observation, m) {
  m.doc() = "torch-gemm-ar tests: observations of the CPU engine";
  auto& tuner = gemm_ar::AutoTuner::instance();

  m.def("row_epilogue_geometry", geometry_of(&gemm_ar::cpu::row_epilogue_geometry),
        "CPU fused engine: (tile rows, tile columns, stripe rows) of an add+RMSNorm call of M x N on `world` local "
        "ranks");
  m.def("wide_row_geometry", geometry_of(&gemm_ar::cpu::wide_row_geometry),
        "CPU fused engine: (tile rows, tile columns, stripe rows) of a gemm_allreduce or gemm_reduce_scatter call of "
        "M x N on `world` local ranks");
  m.def("is_long_k_call", &gemm_ar::cpu::is_long_k_call, pybind11::arg("m"), pybind11::arg("k"),
        "CPU fused engine: whether a gemm_allreduce of [M, K] x [K, N] takes the fewer-product geometries in every "
        "dtype");
  m.def("column_panel_geometry", geometry_of(&gemm_ar::cpu::column_panel_geometry),
        "CPU fused engine: (tile rows, tile columns, stripe rows) of column_panel_geometry for a call of M x N on "
        "`world` local ranks");
  m.def(
      "call_geometry",
      [](const std::string& op, int64_t m, int64_t k, int64_t n, const at::Tensor& like, int world) {
        const auto c = config_of_call("call_geometry", op, m, k, n, like, world);
        return pybind11::make_tuple(c.base_m, c.base_n, c.sub_m);
      },
      "CPU fused engine: (tile rows, tile columns, stripe rows) a call of `op` ('gemm_allreduce', "
      "'add_rmsnorm', or a 2-D 'gemm_reduce_scatter' or 'allgather_gemm' whose whole M is m) of [M, K] x [K, N] in "
      "the dtype of `like` takes on `world` local ranks, under this process's settings and engine options");
  m.def(
      "plan_call",
      [](const std::string& op, int64_t m, int64_t k, int64_t n, const at::Tensor& like, int world, bool epilogue,
         bool in_place) {
        namespace cpu = gemm_ar::cpu;
        const auto config = config_of_call("plan_call", epilogue ? "add_rmsnorm" : op, m, k, n, like, world);
        const bool gather = op == "allgather_gemm", scatter = op == "gemm_reduce_scatter";
        // As FusedEngine lays the call out: sequence-parallel calls in one chunk per rank (2-D, whole M = m).
        const int64_t chunks = gather || scatter ? world : 1, rows = gather || scatter ? m / world : m;
        gemm_ar::TilePlan tiles{};
        gemm_ar::RowChunks row_chunks{};
        TORCH_CHECK_VALUE(gemm_ar::make_row_chunked_plan(&tiles, &row_chunks, chunks, rows, n, k, config.base_m,
                                                         config.base_n, 1, 1, config.sub_m),
                          "plan_call: no tile plan for M=", m, " K=", k, " N=", n);
        const at::ScalarType partial =
            gemm_ar::computes_in_fp32(like) && !config.decode ? at::kFloat : like.scalar_type();
        const int64_t kind = gather    ? gemm_ar::kOpAllgatherGemm
                             : scatter ? gemm_ar::kOpGemmReduceScatter
                                       : gemm_ar::kOpGemmAllreduce;
        const auto plan = cpu::plan_call(cpu::plan_inputs(kind, m, k, n, world, chunks, partial, like.scalar_type(),
                                                          tiles, config, epilogue, in_place));
        return pybind11::dict(pybind11::arg("flow") = cpu::data_flow_name(plan.flow),
                              pybind11::arg("one_product") = plan.one_product,
                              pybind11::arg("slot_output_bytes") = plan.slot_output_bytes,
                              pybind11::arg("decode") = plan.decode, pybind11::arg("described") = cpu::describe(plan));
      },
      pybind11::arg("op"), pybind11::arg("m"), pybind11::arg("k"), pybind11::arg("n"), pybind11::arg("like"),
      pybind11::arg("world"), pybind11::arg("epilogue") = false, pybind11::arg("in_place") = false,
      "CPU fused engine: the data flow (cpu/call_plan.h) a call of `op` ('gemm_allreduce', or a 2-D "
      "'gemm_reduce_scatter' or 'allgather_gemm' whose whole M is m; epilogue: add+RMSNorm, in_place: its in-place "
      "form) of [M, K] x [K, N] in the dtype of `like` takes on `world` local ranks, under this process's settings");
  m.def(
      "call_multiplies_in_one_product",
      [](const std::string& op, int64_t m, int64_t k, int64_t n, const at::Tensor& like, int world) {
        const auto config = config_of_call("call_multiplies_in_one_product", op, m, k, n, like, world);
        return op == "allgather_gemm" ? gemm_ar::cpu::gathers_in_one_product(config)
                                      : gemm_ar::cpu::multiplies_in_one_product(config);
      },
      "CPU fused engine: whether such a call multiplies the rank's whole partial in one GEMM call where the owner "
      "reduces in the compute block (allgather_gemm: all rows in one GEMM call where every shard is in)");
  m.def("prefers_one_product", &gemm_ar::cpu::prefers_one_product, pybind11::arg("m"), pybind11::arg("k"),
        "CPU fused engine: whether the geometries for products that reorder B per call multiply [M, K] x [K, N] in "
        "one GEMM call rather than tile by tile");
  m.def("tile_row_per_rank_geometry", geometry_of(&gemm_ar::cpu::tile_row_per_rank_geometry),
        "CPU fused engine: (tile rows, tile columns, stripe rows) of tile_row_per_rank_geometry for a call of M x N "
        "on `world` local ranks");
  m.def("prefers_row_panels", &gemm_ar::cpu::prefers_row_panels, pybind11::arg("m"), pybind11::arg("k"),
        "CPU fused engine: whether a gemm_allreduce of [M, K] x [K, N] whose products reorder B per call takes one "
        "tile row per rank rather than column panels");
  m.def("reduce_rows", &reduce_rows_for_test, pybind11::arg("partials"), pybind11::arg("out"), pybind11::arg("bank"),
        pybind11::arg("add_into_out"), pybind11::arg("avx512"),
        "CPU engine: the owner's reduction of `partials` (list order) into out and bank, through the AVX-512 loop "
        "(where the CPU has it) or the portable one");
  m.def("set_avx512_reduce", &gemm_ar::cpu::set_avx512_reduce, pybind11::arg("on"),
        "CPU engine: False makes the owner's reduction run the portable loop where it would run the AVX-512 one "
        "(A/B benchmarks); returns the old value");
  m.def(
      "suits_gathered_inputs",
      [](int64_t m, int64_t k, int64_t n, const at::Tensor& like, int world) {
        return gemm_ar::cpu::suits_gathered_inputs(m, k, n, like.scalar_type(), world);
      },
      pybind11::arg("m"), pybind11::arg("k"), pybind11::arg("n"), pybind11::arg("like"), pybind11::arg("world"),
      "CPU engine: whether `auto` times fused/gathered-inputs for a gemm_allreduce bucket of this largest M");
  m.def("gathered_inputs_calls", &gemm_ar::cpu::gathered_inputs_call_count,
        "CPU fused engine: gemm_allreduce calls this process ran with the gathered-inputs flow");
  m.def("shared_output_calls", &gemm_ar::cpu::shared_output_call_count,
        "CPU fused engine: gemm_allreduce calls whose output this process put in a window slot");
  m.def(
      "other_tile_family",
      [](int64_t m, int64_t k, int64_t n, const at::Tensor& like, int world) {
        const auto other = gemm_ar::cpu::other_tile_family(m, k, n, like.scalar_type(), world);
        return std::string(other == gemm_ar::Algorithm::Auto ? "" : gemm_ar::algorithm_name(other));
      },
      pybind11::arg("m"), pybind11::arg("k"), pybind11::arg("n"), pybind11::arg("like"), pybind11::arg("world"),
      "CPU engine: the fused candidate `auto` adds for this gemm_allreduce call (fused/tiles or "
      "fused/few-products: the tile family the geometry rules did not pick), or '' where none");
  m.def("has_avx512_reduce", &gemm_ar::cpu::cpu_has_avx512_reduce,
        "CPU engine: whether the owner's reduction runs its AVX-512 loop on this CPU (fp32 and bf16)");
  m.def(
      "reorders_b_per_product", [](const at::Tensor& t) { return gemm_ar::reorders_b_per_product(t.scalar_type()); },
      "Whether this CPU's product of t's dtype reorders B per call (bf16/fp16 computed natively)");
  m.def("one_shot_calls", &gemm_ar::cpu::one_shot_call_count,
        "CPU fused engine: gemm_allreduce calls this process reduced in one shot");
  m.def("decode_calls", &gemm_ar::cpu::decode_call_count,
        "CPU fused engine: of those, the calls on the decode geometry (one GEMM call of the whole output)");
  m.def("one_product_calls", &gemm_ar::cpu::one_product_call_count,
        "CPU fused engine: calls this process multiplied in one GEMM call");
  m.def("packed_b_available", &gemm_ar::cpu::packed_b_gemm_available,
        "whether torch's BLAS has the packed GEMM the CPU engine's tiles use (oneMKL)");
  m.def("packed_b_panels", &gemm_ar::cpu::packed_b_panel_count,
        "how many B panels this process packed for the CPU engine's tiles");
  m.def("sequential_partial_calls", &gemm_ar::sequential_partial_calls,
        "how many sequential partial products this process computed");
  m.def("dequantized_product_calls", &gemm_ar::dequantized_product_calls,
        "how many dequantized (W8A8, W8A16) partial products this process computed");
  m.def("agreement_payload_calls", &gemm_ar::agreement_payload_calls,
        "how many calls of this process got their result from the agreement exchange");
  m.def("tuner_decide_from_samples", &gemm_ar::decide_from_samples, pybind11::arg("names"), pybind11::arg("samples"),
        pybind11::arg("trust_medians") = true,
        "tests: the candidate a race with these per-round samples decides (the tuner's rule, without running calls)");
  m.def(
      "tuner_clear_memory", [&tuner] { tuner.clear_memory(); }, "tests: forget in-memory decisions");
}
