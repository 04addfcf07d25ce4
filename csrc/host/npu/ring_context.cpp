#include "npu/ring_context.h"

#include <vector>

#include "npu/hccl_context_layout.h"

namespace gemm_ar::npu {

namespace layout = hccl_layout;

void assemble_ring_context(const uint8_t* block, CommContext* ctx, ReadDevice read) {
  layout::Mc2Workspace workspace{};
  read(&workspace, block, sizeof(workspace), "aclrtMemcpy(workspace)");
  layout::OpResParamHead head{};
  read(&head, block + offsetof(layout::OpResParam, localUsrRankId), sizeof(head), "aclrtMemcpy(op resource head)");
  if (head.rankSize == 0 || head.rankSize > kMaxWorld || head.localUsrRankId >= head.rankSize) {
    throw RingContextError(false, "HCCL op resources report rank " + std::to_string(head.localUsrRankId) + " of " +
                                      std::to_string(head.rankSize));
  }
  std::vector<layout::RemoteResPtr> remote(head.rankSize);
  read(remote.data(), block + offsetof(layout::OpResParam, remoteRes), remote.size() * sizeof(layout::RemoteResPtr),
       "aclrtMemcpy(remoteRes)");
  *ctx = CommContext{};
  ctx->work_space = workspace.workspace;
  ctx->work_space_size = workspace.workspaceSize;
  ctx->rank_id = head.localUsrRankId;
  ctx->rank_num = head.rankSize;
  ctx->win_size = head.winSize;
  for (uint32_t peer = 0; peer < head.rankSize; ++peer) {
    if (peer == head.localUsrRankId) {
      ctx->windows_in[peer] = head.localWindowsIn;
      ctx->windows_out[peer] = head.localWindowsOut;
      continue;
    }
    if (remote[peer].nextDevicePtr == 0) {
      throw RingContextError(true, "HCCL has no remote resources for rank " + std::to_string(peer));
    }
    layout::RankRelationResV2 relation{};
    read(&relation, reinterpret_cast<const void*>(remote[peer].nextDevicePtr), sizeof(relation),
         "aclrtMemcpy(rank relation)");
    // The one field that says whether this record really is the peer's: a newer HCCL that moved localRes /
    // remoteRes in OpResParam shows up here (as a wrong rank) instead of as writes to wrong addresses.
    if (relation.remoteUsrRankId != peer || relation.windowsIn == 0) {
      throw RingContextError(true, "HCCL op-resource layout not understood (another HCCL version?): remoteRes[" +
                                       std::to_string(peer) + "] describes rank " +
                                       std::to_string(relation.remoteUsrRankId) +
                                       (relation.windowsIn == 0 ? " with no window" : "") +
                                       "; refusing the RING (A3) fused path, which would write to wrong addresses");
    }
    ctx->windows_in[peer] = relation.windowsIn;
    ctx->windows_out[peer] = relation.windowsOut;
  }
}

}  // namespace gemm_ar::npu
