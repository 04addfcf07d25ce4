// What the fused NPU path keeps per HCCL communicator (design.md §7): the communicator's name and handle, the
// device context HCCL builds for one-sided window access (windowsIn of every rank), the window size, the block
// counts, the call epoch, and this rank's kernel error record. Created on first use by a collective setup over the
// group; never destroyed (HCCL owns the windows for the communicator's lifetime).
#pragma once
#include <ATen/ATen.h>
#include <hccl/hccl_types.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "gemm_ar/kernel_args.hpp"

namespace c10_npu {
struct NPUEvent;
}

namespace gemm_ar::npu {

// Window bytes left to HCCL in front of our region: its own small collectives (this op's rank agreement runs one
// right before the kernels) stage their data at the start of the same window, and a peer may already be writing
// our flags while this rank is still finishing that collective.
constexpr uint64_t kHcclStagingReserveBytes = uint64_t{1} << 20;

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

  HcclComm comm = nullptr;
  bool mesh = false;              // L0 topology is a full mesh (A2); otherwise the RING (A3) context was assembled
  uint64_t comm_ctx_device = 0;   // device address of the CommContext the kernels read
  CommContext host_ctx{};         // host copy of it
  at::Tensor assembled_ctx;       // RING: device memory holding the assembled CommContext
  uint64_t window_bytes = 0;      // smallest window of the group
  int32_t compute_blocks = 0;     // agreed over the group (cube cores)
  int32_t comm_blocks = 0;        // agreed over the group (vector cores)

  // Per call. Guarded by `mutex`.
  std::mutex mutex;
  uint32_t first_epoch = 0;       // epoch of the first fused call (random, agreed): stale window bytes of an
  uint32_t next_epoch = 0;        // earlier process never carry the tags of this one's first calls
  at::Tensor error_device;        // ErrorRecord the kernels write (plain device memory, zeroed once)
  at::Tensor error_host;          // pinned copy, refreshed after every call
  std::shared_ptr<c10_npu::NPUEvent> error_copied;  // recorded after the refresh
  uint32_t reported_error_tag = 0;                  // the last error already raised
};

// The state of `group`'s HCCL communicator on `device`, set up on first use. Collective over `group`: every rank
// calls it for the same group at the same point of the same gemm_allreduce call.
CommState& comm_state(c10d::ProcessGroup& group, const at::Device& device);

}  // namespace gemm_ar::npu
