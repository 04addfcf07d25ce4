// Before any large data moves, ranks exchange a few integers describing their call so that a bad argument on
// one rank, or ranks that disagree on shapes, dtype, bias or algorithm, raise a clear error on every rank
// instead of a hang or a silently wrong sum.
#pragma once
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "common/call_args.h"

namespace gemm_ar {

// Throws the same diagnosis on every rank when any rank's arguments are bad or the ranks disagree.
// One small all_reduce on `group`, bounded by TORCH_GEMM_AR_TIMEOUT_S.
void check_ranks_agree(c10d::ProcessGroup& group, const CallArgs& call, const at::Device& device);

}  // namespace gemm_ar
