// The NPU kernel plans of the sequence-parallel ops (issue 12): gemm_reduce_scatter (GEMM + reduce-scatter along
// dim 0 of the output, RS-only: no all-gather phase) and allgather_gemm (all-gather of a along dim 0, then GEMM).
// Shared by the host (csrc/host/npu), the kernels (csrc/kernels/sp_*_kernel.cpp) and the simulator harness.
//
// Both ops are `world` stacked sub-problems of m_sub rows each, tiled exactly like gemm_allreduce's one problem
// (TilePlan with m = m_sub):
//  - reduce-scatter: sub-problem r is chunk r of the output rows (m_sub = M / world); every rank computes every
//    chunk of its own partial product, and chunk r is reduced by its owner, rank r, into its window, then copied to
//    its `out` (m_sub x N). Chunks never share a tile, so a tile has exactly one owner.
//  - allgather: sub-problem r is rank r's shard of a (m_sub rows each); every rank computes all of them into its
//    own `out` (world * m_sub rows), its own shard first, a peer's rows as they arrive.
// Stacked tile id T = r * plan.tiles + t (t: the tile inside the sub-problem).
//
// KernelArgs::layout (KernelLayout) keeps its field names; their meaning for these ops:
//   reduce-scatter  reduced  = this rank's chunk, pad_m x pad_n (atomic adds of every rank, then copied to out)
//                   contrib  = [chunk-local subtile][source] flags, as for gemm_allreduce; arrival unused (0 bytes)
//                   partial  = world stacked pad_m x pad_n partial products (scratch), queue as usual
//   allgather       reduced  = this rank's shard of a, m_sub x k (ld k), published for the peers to pull
//                   contrib  = [source][comm block] "consumed" flags: the source has pulled all of my shard that
//                              block handles (I may leave the call only after every one of them)
//                   arrival  = [shard][tile row] "row ready" flags, written and read by this rank only (comm
//                              kernel -> compute kernel): that shard's rows are in the gathered buffer
//                   scratch [0, partial_offset) = the gathered a, world * m_sub x k (ld k), returned to the caller
//                   partial  = world stacked pad_m x pad_n products (scratch), copied to `out` by the comm kernel
// The prepared flags keep their place and banking; for allgather prepared[owner][c] means "owner's comm block c
// has published its tile rows of the shard" (tile row mi belongs to comm block mi % Q on every rank).
#pragma once
#include <cstdint>

#include "comm_schedule.hpp"
#include "kernel_args.hpp"
#include "partition.hpp"
#include "swizzle.hpp"

namespace gemm_ar {

// Which sequence-parallel kernel pair a KernelArgs is planned for (the values of the host's OpKind).
enum SpOpCode : uint32_t {
  kSpReduceScatter = 1,
  kSpAllgather = 2,
};

// Compute items: world * tiles stacked tiles, in the order every compute block walks them (block b takes items
// b, b + P, b + 2P, ...: every block starts at the head of the order). Reduce-scatter: the peers' chunks first,
// starting with the next rank's, this rank's own chunk last (its contributions arrive while the others are
// reduced). Allgather: this rank's own shard first (no wait), then the peers' shards in the order they are pulled.
GEMM_AR_FN int64_t sp_item_count(const TilePlan& plan, int64_t world) { return world * plan.tiles; }

GEMM_AR_FN int64_t sp_item_tile(const TilePlan& plan, int64_t world, int64_t me, uint32_t op, int64_t item) {
  const int64_t step = item / plan.tiles;
  const int64_t r = op == kSpReduceScatter ? (me + 1 + step) % world : (me + step) % world;
  return r * plan.tiles + zigzag_tile(item % plan.tiles, plan.n_tiles);
}

// Items compute block b walks, and its j-th (a stacked tile id).
GEMM_AR_FN int64_t sp_block_item_count(const TilePlan& plan, int64_t world, int64_t compute_blocks, int64_t b) {
  const int64_t items = sp_item_count(plan, world);
  if (b < 0 || b >= compute_blocks || b >= items) return 0;
  return (items - 1 - b) / compute_blocks + 1;
}

GEMM_AR_FN int64_t sp_block_item(const TilePlan& plan, int64_t world, int64_t me, uint32_t op,
                                 int64_t compute_blocks, int64_t b, int64_t j) {
  return sp_item_tile(plan, world, me, op, b + j * compute_blocks);
}

// Comm block that publishes and pulls tile row mi of every shard (allgather).
GEMM_AR_FN int64_t sp_row_comm_block(int64_t mi, int64_t comm_blocks) { return mi % comm_blocks; }

GEMM_AR_FN KernelLayout make_sp_kernel_layout(const TilePlan& plan, int64_t elem_bytes, int64_t world,
                                              int64_t compute_blocks, int64_t comm_blocks, uint32_t op) {
  KernelLayout k{};
  const int64_t sub_elems = plan.pad_m * plan.pad_n;
  int64_t at = 0;
  k.prepared_offset = at;
  k.prepared_bytes = prepared_region_bytes(world);
  k.signature_offset = signature_region_offset(world);
  k.signature_bytes = signature_region_bytes(world);
  at = fixed_window_bytes(world);
  k.reduced_offset = at;
  if (op == kSpReduceScatter) {
    k.reduced_bytes = sub_elems * elem_bytes;
    k.contrib_bytes = plan.tiles * plan.stripes * world * kFlagStride;
    k.arrival_bytes = 0;
  } else {
    k.reduced_bytes = plan.m * plan.k * elem_bytes;
    k.contrib_bytes = world * comm_blocks * kFlagStride;
    k.arrival_bytes = world * plan.m_tiles * kFlagStride;
  }
  at = align_up(at + k.reduced_bytes, kWindowAlign);
  k.contrib_offset = at;
  at = align_up(at + k.contrib_bytes, kWindowAlign);
  k.arrival_offset = at;
  at = align_up(at + k.arrival_bytes, kWindowAlign);
  k.window_bytes = at;

  at = op == kSpAllgather ? align_up(world * plan.m * plan.k * elem_bytes, kWindowAlign) : 0;
  k.partial_offset = at;
  k.partial_bytes = world * sub_elems * elem_bytes;
  at = align_up(at + k.partial_bytes, kWindowAlign);
  k.queue_offset = at;
  k.queue_capacity = max_block_items(sp_item_count(plan, world), compute_blocks);
  k.queue_stride = align_up(k.queue_capacity * kQueueSlotBytes, kCacheLine);
  at = align_up(at + compute_blocks * k.queue_stride, kWindowAlign);
  k.scratch_bytes = at;
  return k;
}

// Allgather flags (see the top of this file), relative to the window region.
GEMM_AR_FN int64_t sp_consumed_flag_offset(const KernelLayout& k, int64_t source, int64_t comm_block,
                                           int64_t comm_blocks) {
  return k.contrib_offset + (source * comm_blocks + comm_block) * kFlagStride;
}
GEMM_AR_FN int64_t sp_row_ready_flag_offset(const KernelLayout& k, int64_t shard, int64_t mi, int64_t m_tiles) {
  return k.arrival_offset + (shard * m_tiles + mi) * kFlagStride;
}

// plan_kernel_args for the sequence-parallel kernels: m_sub is the rows of one sub-problem (the chunk of a
// reduce-scatter, the shard of an allgather); false where the kernels cannot run the call.
GEMM_AR_FN bool plan_sp_kernel_args(KernelArgs* args, uint32_t op, int64_t m_sub, int64_t n, int64_t k) {
  if (op != kSpReduceScatter && op != kSpAllgather) return false;
  if (!plan_kernel_args(args, m_sub, n, k)) return false;
  args->layout = make_sp_kernel_layout(args->plan, dtype_bytes(args->dtype), args->world, args->compute_blocks,
                                       args->comm_blocks, op);
  return true;
}

}  // namespace gemm_ar
