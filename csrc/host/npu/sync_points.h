// The only places where the NPU backend waits for the device after setup
// (docs/decisions/0008-npu-call-sequence-without-host-sync.md): kept out of the per-call translation units
// (fused_npu.cpp, npu_op.cpp), which tests/test_npu_per_call_sync.py checks for synchronising calls.
#pragma once
#include "npu/comm_state.h"

namespace gemm_ar::npu {

// TORCH_GEMM_AR_NPU_SYNC_ERRORS=1: waits for the call just queued and raises its failure. Needs state.mutex.
void wait_and_raise_errors(CommState& state);

// torch_gemm_ar.check_errors(): waits for everything queued on every communicator's error record, reads the
// records and raises the first failure not reported yet (a message naming the group, call and rank).
void check_all_errors();

}  // namespace gemm_ar::npu
