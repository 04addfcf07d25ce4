// The CPU engine's window layout: the byte layout of one rank's shared-memory window after its control area
// (cpu/fused_call.h). Every rank computes it from the same parameters, so a region's offset is the same in every
// window and a peer's region is at window_base[peer] + offset (docs/architecture.md §3.3). The NPU kernels lay their
// HCCL windows out with KernelLayout (kernel_args.hpp); both derive from the tile plan (tile_plan.hpp).
#pragma once
#include <cstdint>

#include "fn.hpp"
#include "ownership.hpp"
#include "partition.hpp"
#include "tile_plan.hpp"

namespace gemm_ar {

constexpr int64_t kWindowAlign = 512;  // start of every region (DMA-friendly, keeps regions on separate lines)
constexpr int64_t kCacheLine = 64;     // queue strides are a multiple of it (producers never share a line)
constexpr int64_t kCounterBytes = 4;   // every flag, counter and queue entry is a uint32

// Rounds x >= 0 up to a multiple of a > 0.
GEMM_AR_FN int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

struct LayoutParams {
  int64_t pad_m, pad_n;        // padded output (TilePlan::pad_m / pad_n)
  int64_t elem_bytes;          // output element size in the reduced banks
  int64_t partial_elem_bytes;  // element size of this rank's own product; 0 = no partial region (NPU)
  int64_t world;
  int64_t tiles;               // TilePlan::tiles
  int64_t max_owned_subtiles;  // max_owned_subtile_count(tiles, world, stripes)
  int64_t compute_blocks;      // P: one ready queue each
  int64_t comm_blocks;         // Q
  int64_t queue_capacity;      // tile ids a queue can hold: max_block_items(tiles, compute_blocks)
};

struct WindowLayout {
  int64_t partial_offset, partial_bytes;
  int64_t reduced_offset[2], reduced_bytes;   // two banks, alternated by call parity
  int64_t tile_flag_offset, tile_flag_bytes;  // one uint32 per tile
  int64_t final_offset, final_bytes;          // one uint32 per owner-local subtile
  int64_t queue_offset, queue_stride;         // per compute block: uint32 count, then queue_capacity uint32 ids
  int64_t total_bytes;
};

// True when every count is non-negative and the block counts are positive; make_window_layout assumes it.
GEMM_AR_FN bool layout_params_valid(const LayoutParams& p) {
  return p.pad_m >= 0 && p.pad_n >= 0 && p.elem_bytes > 0 && p.partial_elem_bytes >= 0 && p.world > 0 && p.tiles >= 0 &&
         p.max_owned_subtiles >= 0 && p.compute_blocks > 0 && p.comm_blocks > 0 && p.queue_capacity >= 0;
}

// The parameters that follow from a tile plan and the block counts, filled the same way by every user.
GEMM_AR_FN LayoutParams make_layout_params(const TilePlan& plan, int64_t elem_bytes, int64_t partial_elem_bytes,
                                           int64_t world, int64_t compute_blocks, int64_t comm_blocks) {
  LayoutParams p{};
  p.pad_m = plan.pad_m;
  p.pad_n = plan.pad_n;
  p.elem_bytes = elem_bytes;
  p.partial_elem_bytes = partial_elem_bytes;
  p.world = world;
  p.tiles = plan.tiles;
  p.max_owned_subtiles = max_owned_subtile_count(plan.tiles, world, plan.stripes);
  p.compute_blocks = compute_blocks;
  p.comm_blocks = comm_blocks;
  p.queue_capacity = max_block_items(plan.tiles, compute_blocks);
  return p;
}

// Bytes of one ready queue: the count word and the ids, rounded to whole cache lines so that queues of
// different producers never share a line.
GEMM_AR_FN int64_t queue_stride_bytes(int64_t queue_capacity) {
  return align_up(kCounterBytes * (1 + queue_capacity), kCacheLine);
}

// Regions follow one another in this order, each at the next multiple of kWindowAlign.
GEMM_AR_FN WindowLayout make_window_layout(const LayoutParams& p) {
  WindowLayout w{};
  const int64_t elems = p.pad_m * p.pad_n;
  int64_t at = 0;
  w.partial_offset = at;
  w.partial_bytes = elems * p.partial_elem_bytes;
  at = align_up(at + w.partial_bytes, kWindowAlign);
  w.reduced_bytes = elems * p.elem_bytes;
  for (int bank = 0; bank < 2; ++bank) {
    w.reduced_offset[bank] = at;
    at = align_up(at + w.reduced_bytes, kWindowAlign);
  }
  w.tile_flag_offset = at;
  w.tile_flag_bytes = p.tiles * kCounterBytes;
  at = align_up(at + w.tile_flag_bytes, kWindowAlign);
  w.final_offset = at;
  w.final_bytes = p.max_owned_subtiles * kCounterBytes;
  at = align_up(at + w.final_bytes, kWindowAlign);
  w.queue_offset = at;
  w.queue_stride = queue_stride_bytes(p.queue_capacity);
  at = align_up(at + p.compute_blocks * w.queue_stride, kWindowAlign);
  w.total_bytes = at;
  return w;
}

// Byte offsets of single entries, so every user indexes the regions the same way.
// Element (row, col) of the padded pad_m x pad_n reduced bank `bank` (row-major).
GEMM_AR_FN int64_t reduced_entry_offset(const WindowLayout& w, int64_t bank, int64_t row, int64_t col, int64_t pad_n,
                                        int64_t elem_bytes) {
  return w.reduced_offset[bank & 1] + (row * pad_n + col) * elem_bytes;
}
// Element (row, col) of this rank's padded partial product (row-major).
GEMM_AR_FN int64_t partial_entry_offset(const WindowLayout& w, int64_t row, int64_t col, int64_t pad_n,
                                        int64_t partial_elem_bytes) {
  return w.partial_offset + (row * pad_n + col) * partial_elem_bytes;
}
GEMM_AR_FN int64_t tile_flag_entry_offset(const WindowLayout& w, int64_t t) {
  return w.tile_flag_offset + t * kCounterBytes;
}
GEMM_AR_FN int64_t final_entry_offset(const WindowLayout& w, int64_t l) { return w.final_offset + l * kCounterBytes; }
// Queue of compute block b: its uint32 count at this offset, entry j at + kCounterBytes * (1 + j).
GEMM_AR_FN int64_t queue_count_offset(const WindowLayout& w, int64_t b) { return w.queue_offset + b * w.queue_stride; }
GEMM_AR_FN int64_t queue_entry_offset(const WindowLayout& w, int64_t b, int64_t j) {
  return queue_count_offset(w, b) + kCounterBytes * (1 + j);
}

// allgather_gemm's window: no partial products, but its rank's shard of a ([shard_rows, K], row-major, in the rank's
// own row order) where they would be, one tile flag per tile row (of `tiles` and `m_tiles`, the larger) and no
// owner-local subtiles beyond one final flag; no ready queues.
GEMM_AR_FN LayoutParams allgather_layout_params(int64_t shard_rows, int64_t k, int64_t elem_bytes, int64_t world,
                                                int64_t tiles, int64_t m_tiles, int64_t compute_blocks,
                                                int64_t comm_blocks) {
  LayoutParams p{};
  p.pad_m = 1;
  p.pad_n = shard_rows * k * elem_bytes > 1 ? shard_rows * k * elem_bytes : 1;  // the shard, as bytes
  p.elem_bytes = p.partial_elem_bytes = 1;
  p.world = world;
  p.tiles = tiles > m_tiles ? tiles : m_tiles;
  p.max_owned_subtiles = 1;
  p.compute_blocks = compute_blocks;
  p.comm_blocks = comm_blocks;
  p.queue_capacity = 0;
  return p;
}

// Element (row, 0) of that shard:
GEMM_AR_FN int64_t shard_row_offset(const WindowLayout& w, int64_t row, int64_t k, int64_t elem_bytes) {
  return w.partial_offset + row * k * elem_bytes;
}

// gemm_allreduce's gathered-inputs flow has no partial products either: its rank's a ([M, K]) and then b ([K, N]),
// both row-major, lie where they would; each owner multiplies its rows by every rank's K at once.
GEMM_AR_FN int64_t gathered_a_row_offset(const WindowLayout& w, int64_t row, int64_t k, int64_t elem_bytes) {
  return w.partial_offset + row * k * elem_bytes;
}
GEMM_AR_FN int64_t gathered_b_offset(const WindowLayout& w, int64_t m, int64_t k, int64_t elem_bytes) {
  return w.partial_offset + align_up(m * k * elem_bytes, kWindowAlign);
}
// Then rank 0's bias ([N]; only rank 0's counts, as in the other flows, where rank 0 adds it to its partial).
GEMM_AR_FN int64_t gathered_bias_offset(const WindowLayout& w, int64_t m, int64_t k, int64_t n, int64_t elem_bytes) {
  return gathered_b_offset(w, m, k, elem_bytes) + align_up(k * n * elem_bytes, kWindowAlign);
}
// Bytes from the partial region's start that the gathered inputs take.
GEMM_AR_FN int64_t gathered_input_bytes(int64_t m, int64_t k, int64_t n, int64_t elem_bytes) {
  return align_up(m * k * elem_bytes, kWindowAlign) + align_up(k * n * elem_bytes, kWindowAlign) + n * elem_bytes;
}

}  // namespace gemm_ar
