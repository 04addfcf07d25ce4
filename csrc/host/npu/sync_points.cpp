#include "npu/sync_points.h"

#include <torch_npu/csrc/core/npu/NPUEvent.h>
#include <torch_npu/csrc/core/npu/NPUFunctions.h>
#include <torch_npu/csrc/core/npu/NPUGuard.h>

#include <cstring>

#include "common/call_args.h"
#include "common/rank_agreement.h"

namespace gemm_ar::npu {
namespace {

// Reads a record that is up to date (the caller synchronised) and raises what it shows. Needs state.mutex.
void raise_from_host_copy(CommState& state) {
  ErrorRecord record;
  std::memcpy(&record, state.error_host.data_ptr(), sizeof(record));
  const std::string failure =
      state.calls.take_unreported(record, state.group_name, &signature_field_name, &error_code_summary);
  TORCH_CHECK(failure.empty(), failure);
}

}  // namespace

void wait_and_raise_errors(CommState& state) {
  if (state.error_copied) state.error_copied->synchronize();
  raise_from_host_copy(state);
}

void check_all_errors() {
  for (CommState* state : all_comm_states()) {
    if (!state->unavailable.empty() || !state->error_device.defined()) continue;
    c10_npu::NPUGuard guard(state->device);
    std::lock_guard<std::mutex> lock(state->mutex);
    // Every stream of the device, not only the current one: calls queued from other streams or threads included.
    c10_npu::device_synchronize();
    state->error_host.copy_(state->error_device, /*non_blocking=*/false);
    raise_from_host_copy(*state);
  }
}

}  // namespace gemm_ar::npu
