// `sequential` and `chunked` (design.md §4): any ProcessGroup (gloo, HCCL, NCCL), any number of hosts.
#pragma once
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "common/call_args.h"

namespace gemm_ar {

// matmul, then one all_reduce of the whole output.
at::Tensor run_sequential(const CallArgs& call, c10d::ProcessGroup& group);

// M split into `chunks` row blocks: block i is multiplied while block i-1's async all_reduce is in flight.
at::Tensor run_chunked(const CallArgs& call, c10d::ProcessGroup& group, int64_t chunks);

// world size 1: the plain product.
at::Tensor run_local(const CallArgs& call);

}  // namespace gemm_ar
