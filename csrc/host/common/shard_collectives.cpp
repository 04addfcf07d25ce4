#include "common/shard_collectives.h"

#include "common/settings.h"

namespace gemm_ar {

// Both move the sharded dim to the front so that every rank's part is one contiguous block of the flat buffer
// (what the *_into_tensor collectives exchange), in the call dtype as the user's baseline does.
at::Tensor all_gather_along(const at::Tensor& shard, int64_t dim, c10d::ProcessGroup& group) {
  const int64_t world = group.getSize();
  auto input = shard.movedim(dim, 0).contiguous();
  std::vector<int64_t> gathered_shape(input.sizes().begin(), input.sizes().end());
  gathered_shape[0] *= world;
  auto gathered = at::empty(gathered_shape, input.options());
  if (input.numel() > 0) {  // every rank has the same shape (agreed before), so all skip together
    c10d::AllgatherOptions options;
    options.timeout = wait_timeout();
    group._allgather_base(gathered, input, options)->wait(options.timeout);
  }
  return gathered.movedim(0, dim).contiguous();
}

at::Tensor reduce_scatter_along(const at::Tensor& full, int64_t dim, c10d::ProcessGroup& group) {
  const int64_t world = group.getSize();
  auto input = full.movedim(dim, 0).contiguous();
  std::vector<int64_t> chunk_shape(input.sizes().begin(), input.sizes().end());
  TORCH_CHECK(chunk_shape[0] % world == 0, "reduce_scatter_along: internal error: size ", chunk_shape[0],
              " not divisible by ", world);
  chunk_shape[0] /= world;
  auto chunk = at::empty(chunk_shape, input.options());
  if (chunk.numel() > 0) {
    c10d::ReduceScatterOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    options.timeout = wait_timeout();
    group._reduce_scatter_base(chunk, input, options)->wait(options.timeout);
  }
  return chunk.movedim(0, dim).contiguous();
}

}  // namespace gemm_ar
