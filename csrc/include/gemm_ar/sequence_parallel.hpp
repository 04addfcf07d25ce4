// The NPU kernel plans of the sequence-parallel ops (docs/decisions/0010-sequence-parallel-ops.md): gemm_reduce_scatter
// (GEMM + reduce-scatter along dim 0 of the output, RS-only: no all-gather phase) and allgather_gemm (all-gather of a
// along dim 0, then GEMM). Shared by the host (csrc/host/npu), the kernels (csrc/kernels/sp_*_kernel.cpp) and the
// simulator harness.
//
// Both ops tile their M output rows as `world` row chunks of m_sub rows (row_chunks.hpp, make_row_chunked_plan:
// KernelArgs::plan is the whole M = world * m_sub, KernelArgs::chunks says where the chunks are), chunk g being
// rank g's rows, and the tiles of chunk g the run chunk_tile(plan, chunks, g, 0 ...) of the plan's tile ids:
//  - reduce-scatter: chunk g is rank g's rows of the output; every rank computes every chunk of its own partial
//    product, and the chunk's tiles are owned by its rank (ownership in runs of chunk_ownership_run), which reduces
//    them into its window, then copies them to its `out` (m_sub x N). Chunks never share a tile, so a tile has
//    exactly one owner.
//  - allgather: chunk g is rank g's shard of a; every rank computes all of them into its own `out`
//    (world * m_sub rows), its own shard first, a peer's rows as they arrive.
// What is op-specific lives here: the order the compute blocks walk the tiles, the allgather's flags, the layout's
// region sizes (placed by kernel_args.hpp's place_kernel_layout).
//
// The reduce-scatter uses KernelArgs::layout (KernelLayout) as gemm_allreduce does: reduced = this rank's chunk,
// padded (its tiles; chunked_owner_padded_row0), pad_n wide (atomic adds of every rank, then copied to out);
// contrib = [owner-local subtile][source] flags (run_local_subtile); arrival unused (0 bytes); partial = the
// pad_m x pad_n partial products of the whole plan (scratch), queue as usual.
// The allgather has regions of its own, placed in the same slots: AllgatherLayout names them. The prepared flags
// keep their place and banking; for allgather prepared[owner][c] means "owner's comm block c has published its tile
// rows of the shard" (a chunk's local tile row i belongs to comm block i % Q on every rank).
#pragma once
#include <cstdint>

#include "kernel_args.hpp"
#include "op_kind.hpp"
#include "ownership.hpp"
#include "row_chunks.hpp"
#include "swizzle.hpp"

namespace gemm_ar {

// The sequence-parallel kernel pairs are those of kOpGemmReduceScatter and kOpAllgatherGemm (op_kind.hpp).

// The NPU kernels' row chunks: one per rank (the sharded dim is dim 0).
GEMM_AR_FN bool sp_chunks_usable(const RowChunks& c, int64_t world) { return c.count == world && c.rows > 0; }

// Compute items: every tile of the plan, in the order every compute block walks them (block b takes items
// b, b + P, b + 2P, ...: every block starts at the head of the order), chunk by chunk, each chunk in zig-zag
// order. Reduce-scatter: the peers' chunks first, starting with the next rank's, this rank's own chunk last (its
// contributions arrive while the others are reduced). Allgather: this rank's own shard first (no wait), then the
// peers' shards in the order they are pulled.
GEMM_AR_FN int64_t sp_item_tile(const TilePlan& plan, const RowChunks& c, int64_t me, uint32_t op, int64_t item) {
  const int64_t per_chunk = chunk_tile_count(plan, c);
  if (per_chunk <= 0 || c.count <= 0) return 0;  // no items: nothing to walk
  const int64_t step = item / per_chunk;
  const int64_t g = op == kOpGemmReduceScatter ? (me + 1 + step) % c.count : (me + step) % c.count;
  return chunk_tile(plan, c, g, zigzag_tile(item % per_chunk, plan.n_tiles));
}

// Items compute block b walks, and its j-th (a plan tile id).
GEMM_AR_FN int64_t sp_block_item_count(const TilePlan& plan, int64_t compute_blocks, int64_t b) {
  if (b < 0 || b >= compute_blocks || b >= plan.tiles) return 0;
  return (plan.tiles - 1 - b) / compute_blocks + 1;
}

GEMM_AR_FN int64_t sp_block_item(const TilePlan& plan, const RowChunks& c, int64_t me, uint32_t op,
                                 int64_t compute_blocks, int64_t b, int64_t j) {
  return sp_item_tile(plan, c, me, op, b + j * compute_blocks);
}

GEMM_AR_FN KernelLayout make_sp_kernel_layout(const TilePlan& plan, const RowChunks& c, int64_t elem_bytes,
                                              int64_t world, int64_t compute_blocks, int64_t comm_blocks, uint32_t op) {
  LayoutRegionBytes r{};
  if (op == kOpGemmReduceScatter) {
    const int64_t run = chunk_ownership_run(plan, c);
    // The tiles of the rank that owns the most.
    r.reduced = run_owned_tile_count(plan.tiles, world, 0, run) * plan.base_m * plan.base_n * elem_bytes;
    r.contrib = contrib_region_bytes(plan, world, run);
    r.arrival = 0;
    r.scratch_head = 0;
  } else {
    r.reduced = chunked_owner_rows(c, world, 0) * plan.k * elem_bytes;
    r.contrib = world * comm_blocks * kFlagStride;
    r.arrival = plan.m_tiles * kFlagStride;
    r.scratch_head = plan.m * plan.k * elem_bytes;
  }
  return place_kernel_layout(plan, elem_bytes, world, compute_blocks, r);
}

// allgather_gemm's regions, in the slots make_sp_kernel_layout sized for them (window offsets relative to the
// window region, scratch offsets to KernelArgs::scratch).
struct AllgatherLayout {
  int64_t shard_offset;      // window: this rank's shard of a, m_sub x k (ld k), for the peers
  int64_t consumed_offset;   // window: [source][comm block] flags: the source has pulled all of my shard that block
                             // handles (I leave the call only after every one)
  int64_t row_ready_offset;  // window, this rank only: [tile row] flags (comm kernel -> compute kernel): that tile
                             // row's rows of a are in the gathered a
  int64_t gathered_offset;   // scratch: the gathered a, world * m_sub x k (ld k), returned to the caller
};
// The products (KernelLayout::partial_offset) and the ready queues are placed as for every op.

GEMM_AR_FN AllgatherLayout allgather_layout(const KernelLayout& k) {
  AllgatherLayout g{};
  g.shard_offset = k.reduced_offset;
  g.consumed_offset = k.contrib_offset;
  g.row_ready_offset = k.arrival_offset;
  g.gathered_offset = 0;  // the scratch's head (LayoutRegionBytes::scratch_head)
  return g;
}

GEMM_AR_FN int64_t ag_consumed_flag_offset(const AllgatherLayout& g, int64_t source, int64_t comm_block,
                                           int64_t comm_blocks) {
  return g.consumed_offset + (source * comm_blocks + comm_block) * kFlagStride;
}
GEMM_AR_FN int64_t ag_row_ready_flag_offset(const AllgatherLayout& g, int64_t mi) {
  return g.row_ready_offset + mi * kFlagStride;
}

// plan_kernel_args for the sequence-parallel kernels: m_sub is the rows of one chunk (the reduce-scatter's output
// rows of one rank, the allgather's shard); false where the kernels cannot run the call.
GEMM_AR_FN bool plan_sp_kernel_args(KernelArgs* args, uint32_t op, int64_t m_sub, int64_t n, int64_t k) {
  if (op != kOpGemmReduceScatter && op != kOpAllgatherGemm) return false;
  if (!kernel_counts_plannable(args) || m_sub <= 0 || n <= 0 || k <= 0) return false;
  if (!plan_npu_tiles(args, args->world, m_sub, n, k)) return false;
  args->layout = make_sp_kernel_layout(args->plan, args->chunks, dtype_bytes(args->dtype), args->world,
                                       args->compute_blocks, args->comm_blocks, op);
  return true;
}

}  // namespace gemm_ar
