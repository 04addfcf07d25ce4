// Which data flow a call of the CPU engine takes, as a value: a pure function of the agreed call, the call's
// geometry and the engine's options, so that every rank reaches the same plan (they agree on all of its inputs but
// the output slot, which only says where this rank's own rows go) and tests check it as a table
// (tests/engine_observation: plan_call).
// The flows: docs/architecture.md §3.3, "Data flows".
#pragma once
#include <c10/core/ScalarType.h>
#include <gemm_ar/tile_plan.hpp>

#include <cstdint>
#include <string>

#include "cpu/engine_config.h"

namespace gemm_ar::cpu {

enum class DataFlow : int {
  // Compute blocks publish every tile; comm blocks reduce the owned subtiles and copy the rest (threads or inline).
  kCommBlocks,
  // One core per rank: the owner multiplies the peers' tiles first and reduces its own last (owner_last_compute.cpp).
  kOwnerLast,
  // A small gemm_allreduce: every rank sums every rank's whole partial, one phase (one_shot_compute.cpp).
  kOneShot,
  // Output much larger than the inputs: ranks publish their a and b, owners multiply every rank's K at once
  // (gathered_inputs.cpp; only as `auto`'s fused/gathered-inputs candidate).
  kGatheredInputs,
  // allgather_gemm: ranks publish their shard; every rank multiplies the rows as they arrive (allgather_call.cpp).
  kGatheredShards,
};
const char* data_flow_name(DataFlow flow);

struct CallPlanInputs {
  int64_t op = 0;  // OpKind as the engine runs it (gemm_allreduce_add_rmsnorm as gemm_allreduce)
  int64_t m = 0, n = 0;
  int world = 1;
  int64_t row_chunks = 1;                  // the sequence-parallel ops' chunks (one otherwise)
  int64_t partial_elem = 4, out_elem = 4;  // bytes per element of the partial products and of the output
  bool partial_is_out_dtype = true;
  int64_t gathered_input_bytes = 0;  // what the gathered-inputs flow would publish (cpu/gathered_inputs.h)
  int64_t partial_region_bytes = 0;  // this rank's padded partial product
  bool row_epilogue = false, in_place = false;
  // The call's geometry (EngineConfig): comm between tiles on the caller's thread, the gathered-inputs family,
  // one product per call where the geometry asks for it (and one compute block).
  bool comm_inline = false, gathered_inputs_family = false, geometry_one_product = false;
  bool decode_geometry = false;  // EngineConfig::decode (engine_config.h)
  // Engine options (cpu/engine_options.h) and output slots per window (cpu/shared_outputs.h).
  bool overlap = true, owner_last = true, one_shot = true, one_product = true;
  int output_slots = 0;
};

struct CallPlan {
  DataFlow flow = DataFlow::kCommBlocks;
  bool one_product = false;       // this rank's whole partial (allgather_gemm: all rows) in one GEMM call
  int64_t slot_output_bytes = 0;  // > 0: the output goes into a window slot of this size where one is free
  // One shot on the decode geometry (engine_config.h, decode_geometry), 2-byte partials included: the rank's partial
  // in one GEMM call into its bank, every rank summing every partial.
  bool decode = false;
  bool owner_reduces_in_compute() const { return flow != DataFlow::kCommBlocks && flow != DataFlow::kGatheredShards; }
};

CallPlan plan_call(const CallPlanInputs& in);

// The inputs of a call's plan: the call (op as the engine runs it, shape, dtypes, its tile plan and geometry) and
// this process's engine options and output slots.
CallPlanInputs plan_inputs(int64_t op, int64_t m, int64_t k, int64_t n, int world, int64_t row_chunks,
                           at::ScalarType partial_dtype, at::ScalarType out_dtype, const TilePlan& tiles,
                           const EngineConfig& config, bool row_epilogue, bool in_place);
std::string describe(const CallPlan& plan);  // e.g. "owner-last, one product, output slot of 4194304 bytes"

}  // namespace gemm_ar::cpu
