// The CPU backend of the shared op flow (cpu/cpu_op.cpp): dtypes, fused engine, `auto` policy, agreement channel.
// Shared by every op of the family that runs a gemm_allreduce on CPU.
#pragma once
#include "common/op_flow.h"

namespace gemm_ar::cpu {

const BackendHooks& cpu_backend();

}  // namespace gemm_ar::cpu
