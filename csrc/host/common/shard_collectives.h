// The two collectives of sequence parallelism along any dimension of a tensor, on any ProcessGroup: what the
// `sequential` algorithm of gemm_reduce_scatter / allgather_gemm runs after / before its matmul.
#pragma once
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace gemm_ar {

// Concatenation along `dim` of every rank's `shard` (rank order); shards must have equal shapes on every rank.
at::Tensor all_gather_along(const at::Tensor& shard, int64_t dim, c10d::ProcessGroup& group);

// Rank r's r-th equal chunk along `dim` of the sum over ranks of `full`; full.size(dim) divisible by the world size.
at::Tensor reduce_scatter_along(const at::Tensor& full, int64_t dim, c10d::ProcessGroup& group);

}  // namespace gemm_ar
