// What the fused NPU path keeps per HCCL communicator (docs/decisions/0013-npu-hccl-windows-and-setup.md): the
// communicator's name and handle, the device context HCCL builds for one-sided window access (windowsIn of every
// rank), the window size, the block counts, the call epoch, and this rank's kernel error record. Created on first use
// by a collective setup over the group; never destroyed (HCCL owns the windows for the communicator's lifetime).
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/kernel_error_watch.h"
#include "gemm_ar/kernel_args.hpp"
#include "npu/device_runtime.h"
#include "npu/fused_call_sequence.h"

namespace gemm_ar::npu {

// Window bytes left to HCCL in front of our region: its own small collectives (the first call's rank agreement
// runs one right before the kernels) stage their data at the start of the same window, and a peer may already be
// writing our flags while this rank is still finishing that collective. Plus a guard gap for HCCL's AIV expansion
// mode (HCCL_OP_EXPANSION_MODE=AIV), whose vector-core collectives keep a 3 MiB flag area (AIV_FLAG_BUFFER_SIZE in
// HCCL's AIV kernels) in a communicator buffer; docs/ascend.md says why it sits here.
constexpr uint64_t kHcclStagingBytes = uint64_t{1} << 20;
constexpr uint64_t kHcclAivGuardBytes = uint64_t{3} << 20;
constexpr uint64_t kHcclStagingReserveBytes = kHcclStagingBytes + kHcclAivGuardBytes;

// What keeps the fused path from running a call; `auto` warns once per kind when it falls back.
enum class FusedBlocker { kNone, kDtype, kShape, kWorld, kBackend, kSymbols, kTopology, kSetup, kWindow };

struct CommState {
  std::string group_name;  // c10d group name
  std::string hcom_name;   // HCCL communicator name
  int rank = 0, world = 0;
  c10::Device device{c10::DeviceType::PrivateUse1, 0};

  // Empty when the fused path can use this communicator; otherwise why not. Identical on every rank.
  std::string unavailable;
  FusedBlocker unavailable_kind = FusedBlocker::kNone;

  HcclCommHandle comm = nullptr;
  bool mesh = false;             // L0 topology is a full mesh (A2); otherwise the RING (A3) context was assembled
  uint64_t comm_ctx_device = 0;  // device address of the CommContext the kernels read
  CommContext host_ctx{};        // host copy of it
  at::Tensor assembled_ctx;      // RING: device memory holding the assembled CommContext
  uint64_t window_bytes = 0;     // smallest window of the group
  int32_t compute_blocks = 0;    // agreed over the group (cube cores)
  int32_t comm_blocks = 0;       // agreed over the group (vector cores)

  int64_t aicore_timeout_ms = 0;  // the runtime's AI Core op-execute timeout (common/kernel_timeout.h)
  // The comm kernels' stream, this group's own: a pool stream may be the caller's (allgather_gemm's compute kernel
  // then waits for rows only the comm kernel queued behind it delivers) or one an HCCL collective runs on.
  NativeStream comm_stream = nullptr;

  // Per call. Guarded by `mutex`.
  std::mutex mutex;
  // Epochs start at a random value agreed at setup, so stale window bytes of an earlier process never carry the
  // tags of this one's first calls; the watch also knows which failures were reported.
  KernelErrorWatch calls;
  // Set after the first fused call was agreed over the process group: from then on fused calls agree through the
  // window only (the comm kernel compares the ranks' signatures), with no host synchronisation.
  bool agreed = false;
  at::Tensor epoch_device;   // int64 [1]: the epoch the kernels use (KernelArgs::epoch_counter), +1 on the
                             // caller's stream after every call, so graph replays get new epochs too
  at::Tensor error_device;   // ErrorRecord the kernels write (plain device memory, zeroed once)
  at::Tensor error_host;     // pinned copy, refreshed asynchronously after every call
  DeviceEvent error_copied;  // recorded after the refresh
  // Where the group's previous fused call ended, on whatever stream: the next one waits for it (fused_call_sequence.h).
  GroupOrder<DeviceEvent> order;
  std::vector<at::Tensor> captured_args;  // pinned KernelArgs copies graph replays read again
};

// The state of `group`'s HCCL communicator on `device`, set up on first use. Collective over `group`: every rank
// calls it for the same group at the same point of the same gemm_allreduce call.
CommState& comm_state(c10d::ProcessGroup& group, const at::Device& device);

// Every CommState set up so far (check_errors, interpreter exit).
std::vector<CommState*> all_comm_states();

}  // namespace gemm_ar::npu
