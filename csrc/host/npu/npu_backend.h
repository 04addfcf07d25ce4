// The NPU's BackendHooks (npu_op.cpp): dtypes, the fused path, the `auto` policy and the in-kernel agreement, shared
// by every op registered for PrivateUse1.
#pragma once
#include "common/op_flow.h"

namespace gemm_ar::npu {

const BackendHooks& npu_backend();

}  // namespace gemm_ar::npu
