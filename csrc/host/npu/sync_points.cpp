#include "npu/sync_points.h"

#include <c10/core/DeviceGuard.h>

#include <cstring>

#include "common/call_args.h"
#include "common/rank_agreement.h"
#include "npu/device_runtime.h"

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
  if (state.error_copied) device_control().wait(state.error_copied);
  raise_from_host_copy(state);
}

void check_all_errors() {
  for (CommState* state : all_comm_states()) {
    if (!state->unavailable.empty() || !state->error_device.defined()) continue;
    c10::DeviceGuard guard(state->device);
    std::lock_guard<std::mutex> lock(state->mutex);
    // Every stream of the device, not only the current one: calls queued from other streams or threads included.
    device_control().synchronize_device(state->device);
    device_control().copy_now(state->error_host, state->error_device);
    raise_from_host_copy(*state);
  }
}

}  // namespace gemm_ar::npu
