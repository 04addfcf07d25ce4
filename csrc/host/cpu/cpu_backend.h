// The CPU backend of the shared op flow (cpu/cpu_op.cpp): dtypes, fused engine, `auto` policy, agreement channel.
// Shared by every op of the family that runs a gemm_allreduce on CPU.
#pragma once
#include <functional>
#include <string_view>

#include "common/op_flow.h"

namespace gemm_ar::cpu {

class FusedEngine;

const BackendHooks& cpu_backend();
// Runs `body` (an op flow with cpu_backend()) as one call of `op_name` on group `group_name`: with the group's call
// lock held, its engine set as this thread's current one (the hooks use it) and the op named (common/current_op.h).
void with_call_engine(std::string_view op_name, std::string_view group_name, const std::function<void()>& body);
// The engine of the call running on this thread (inside with_call_engine).
FusedEngine& engine_of_this_call(c10d::ProcessGroup& group);

}  // namespace gemm_ar::cpu
