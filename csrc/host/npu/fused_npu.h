// The `fused` algorithm on Ascend NPUs (docs/architecture.md §3.4, docs/decisions/0013-npu-hccl-windows-and-setup.md):
// the cube GEMM kernel on the caller's stream and the vector reduce-scatter/all-gather kernel on the group's own comm
// stream, both
// working over HCCL's one-sided windows.
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>
#include <tuple>

#include "common/add_rmsnorm.h"
#include "common/call_args.h"
#include "common/rank_agreement.h"
#include "npu/comm_state.h"

namespace gemm_ar::npu {

struct FusedCheck {
  FusedBlocker blocker = FusedBlocker::kNone;
  std::string reason;  // empty when the fused path can run the call
};

// Which variant of gemm_allreduce's kernels `fused` runs (gemm_ar::KernelVariant): the decode kernels for
// gemm_allreduce and gemm_allreduce_add_rmsnorm at M <= kDecodeMaxM with a partial of at most 512 KiB
// (docs/ascend.md, "Decode"), the tiled ones otherwise. A function of the agreed arguments alone, so the same on
// every rank; it is also in the signature the kernels compare.
uint32_t fused_variant(const CallArgs& call);

// Whether the fused path can run this call on this group, and if not why. The answer is the same on every rank
// (it rests on the agreed arguments and on values agreed when the communicator was set up). May set up the
// communicator, which is collective over `group`.
FusedCheck check_fused(const CallArgs& call, c10d::ProcessGroup& group);

// Runs the call; check_fused must have passed. Returns an ordinary tensor of call.out_shape. A failure of an
// earlier call on the same communicator (a peer that never arrived) is raised here; with
// TORCH_GEMM_AR_NPU_SYNC_ERRORS=1 every call waits for its kernels and raises its own failure.
at::Tensor run_fused(const CallArgs& call, c10d::ProcessGroup& group);

// `fused` of gemm_allreduce_add_rmsnorm (check_fused must have passed): run_fused with the add+RMSNorm epilogue in
// the comm kernel, which writes out (reduced + bias + residual) and ops.normed2d. Same error reporting as run_fused.
at::Tensor run_fused_add_rmsnorm(const CallArgs& call, c10d::ProcessGroup& group, const AddRmsNormOperands& ops);

// `fused` of the sequence-parallel ops (dim 0; check_fused must have passed): this rank's chunk of
// reduce_scatter(a @ b (+ bias once)), and (all_gather(a) @ b (+ bias), the gathered a). Same error reporting as
// run_fused.
at::Tensor run_fused_reduce_scatter(const CallArgs& call, c10d::ProcessGroup& group);
std::tuple<at::Tensor, at::Tensor> run_fused_allgather(const CallArgs& call, c10d::ProcessGroup& group);

// The NPU's rank agreement (BackendHooks::check_agreement; docs/decisions/0004-rank-agreement-before-data-moves.md).
// The group's first fused call, and every call of another algorithm, exchange signatures over the process group (a
// host synchronisation). After that, a fused call only puts its signature in the kernel arguments and the comm kernel
// compares the ranks' signatures through the window before it moves data: no synchronisation, no copy to the host. A
// rank whose arguments are bad (or whose M is 0) launches a signature-only comm kernel, so that its peers' kernels
// stop at once, and raises.
// Returns every rank's signature when the exchange ran, nothing when the kernels compare.
std::vector<CallSignature> agree_fused(const CallArgs& call, Algorithm chosen, c10d::ProcessGroup& group);

}  // namespace gemm_ar::npu
