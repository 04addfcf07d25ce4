#include "cpu/call_plan.h"

#include <gemm_ar/layout.hpp>

#include "cpu/call_geometry.h"
#include "cpu/engine_options.h"
#include "cpu/fused_call.h"
#include "cpu/shared_outputs.h"

namespace gemm_ar::cpu {

const char* data_flow_name(DataFlow flow) {
  switch (flow) {
    case DataFlow::kCommBlocks: return "comm-blocks";
    case DataFlow::kOwnerLast: return "owner-last";
    case DataFlow::kOneShot: return "one-shot";
    case DataFlow::kGatheredInputs: return "gathered-inputs";
    case DataFlow::kGatheredShards: return "gathered-shards";
  }
  return "?";
}

CallPlan plan_call(const CallPlanInputs& in) {
  CallPlan plan;
  const bool geometry_one_product = in.geometry_one_product && in.one_product;
  if (in.op == kOpAllgatherGemm) {
    plan.flow = DataFlow::kGatheredShards;
    plan.one_product = geometry_one_product && in.comm_inline;
    return plan;
  }
  // One core per rank: nothing would overlap the comm blocks' reduction, so save its memory traffic instead.
  const bool owner_last = in.comm_inline && in.overlap && in.owner_last;
  const bool plain_allreduce = in.op == kOpGemmAllreduce && in.row_chunks == 1;
  if (!owner_last) return plan;
  const bool gathered = in.gathered_inputs_family && plain_allreduce && !in.row_epilogue && !in.in_place &&
                        in.partial_is_out_dtype && in.gathered_input_bytes <= in.partial_region_bytes;
  // Small outputs: every rank reads (world - 1) whole partials from its peers in one shot, at most
  // kOneShotMaxReadBytes. Not with 2-byte partials (bf16/fp16 computed natively): they cost more to reduce than to
  // copy, and one shot reduces the whole output on every rank (docs/journal/performance-journal.md); except on the
  // decode geometry, whose few rows cost microseconds either way, where one phase saves a wait on the owners.
  const int64_t one_shot_reads = in.m * in.n * in.partial_elem * (in.world - 1);
  const bool one_shot = !gathered && in.op == kOpGemmAllreduce && in.world > 1 &&
                        (in.partial_elem >= 4 || in.decode_geometry) && one_shot_reads <= kOneShotMaxReadBytes &&
                        in.one_shot;
  plan.flow = gathered ? DataFlow::kGatheredInputs : one_shot ? DataFlow::kOneShot : DataFlow::kOwnerLast;
  plan.one_product = geometry_one_product && plain_allreduce && !gathered;
  plan.decode = one_shot && in.decode_geometry;
  // Peers copy the owners' rows from their outputs (the owner-last walk writes them once and last); not where the
  // output changes after the rows are final (an epilogue, the in-place residual).
  const bool slot_output = !one_shot && in.op == kOpGemmAllreduce && in.world > 1 && !in.row_epilogue && !in.in_place &&
                           in.m * in.n * in.out_elem >= kMinSlotOutputBytes && in.output_slots > 0;
  plan.slot_output_bytes = slot_output ? in.m * in.n * in.out_elem : 0;
  return plan;
}

CallPlanInputs plan_inputs(int64_t op, int64_t m, int64_t k, int64_t n, int world, int64_t row_chunks,
                           at::ScalarType partial_dtype, at::ScalarType out_dtype, const TilePlan& tiles,
                           const EngineConfig& config, bool row_epilogue, bool in_place) {
  const EngineOptions& options = engine_options();
  CallPlanInputs in;
  in.op = op;
  in.m = m;
  in.n = n;
  in.world = world;
  in.row_chunks = row_chunks;
  in.partial_elem = static_cast<int64_t>(c10::elementSize(partial_dtype));
  in.out_elem = static_cast<int64_t>(c10::elementSize(out_dtype));
  in.partial_is_out_dtype = partial_dtype == out_dtype;
  in.gathered_input_bytes = gathered_input_bytes(m, k, n, in.partial_elem);
  in.partial_region_bytes = tiles.pad_m * tiles.pad_n * in.partial_elem;
  in.row_epilogue = row_epilogue;
  in.in_place = in_place;
  in.comm_inline = config.comm_inline;
  in.gathered_inputs_family = config.gathered_inputs;
  in.geometry_one_product = config.one_product && config.compute_blocks == 1;
  in.decode_geometry = config.decode;
  in.overlap = option(options.overlap);
  in.owner_last = option(options.owner_last);
  in.one_shot = option(options.one_shot);
  in.one_product = option(options.one_product);
  in.output_slots = shared_output_slots();
  return in;
}

std::string describe(const CallPlan& plan) {
  std::string text = data_flow_name(plan.flow);
  if (plan.decode) text += ", decode";
  if (plan.one_product) text += ", one product";
  if (plan.slot_output_bytes > 0) text += ", output slot of " + std::to_string(plan.slot_output_bytes) + " bytes";
  return text;
}

}  // namespace gemm_ar::cpu
