// RING topologies (A3): HCCL returns its op-resource block instead of a ready context, and the host assembles the
// CommContext the kernels read (this rank's windows from the block's head, every peer's from the rank-relation
// record its remoteRes[] entry points to). Free of torch, ACL and HCCL so that the kernel simulator can run the
// kernels on a context assembled by exactly this code from a fake block (tests/kernels_sim, RING mode).
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "gemm_ar/kernel_args.hpp"

namespace gemm_ar::npu {

// Copies `bytes` from device address `device` to host memory `host` (aclrtMemcpy on the NPU, memcpy in the
// simulator); throws on failure.
using ReadDevice = void (*)(void* host, const void* device, size_t bytes, const char* what);

struct RingContextError : std::runtime_error {
  RingContextError(bool mismatch, const std::string& message) : std::runtime_error(message), mismatch(mismatch) {}
  bool mismatch;  // the block does not describe the group as expected (vs. an unreadable block)
};

// Builds *ctx from the op-resource block at device address `block`. Checks what can be checked (rank and size,
// that every peer has a record naming that peer and a window) and throws RingContextError otherwise.
void assemble_ring_context(const uint8_t* block, CommContext* ctx, ReadDevice read);

}  // namespace gemm_ar::npu
