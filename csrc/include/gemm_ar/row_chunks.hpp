// Row-chunked tile plans for the sequence-parallel ops: the M output rows are `count` equal chunks of `rows` rows
// (one per rank, or one per (batch, rank) when the sharded dim is not the first), and the tile grid is laid over
// each chunk on its own, so that no tile straddles two chunks. Chunk g belongs to rank g % world: it reduces the
// chunk's tiles (reduce-scatter) or holds the chunk's rows of a (all-gather). A plain tile plan is one chunk.
#pragma once
#include <cstdint>

#include "fn.hpp"
#include "ownership.hpp"
#include "tile_plan.hpp"

namespace gemm_ar {

struct RowChunks {
  int64_t count;    // chunks
  int64_t rows;     // rows of each chunk
  int64_t m_tiles;  // tile rows of each chunk (ceil(rows / base_m))
};

// Fills *plan (M = count * rows, count * m_tiles tile rows, padded per chunk) and *chunks; false (both untouched)
// for count <= 0, rows < 0, sizes that would overflow, or whatever make_tile_plan rejects.
GEMM_AR_FN bool make_row_chunked_plan(TilePlan* plan, RowChunks* chunks, int64_t count, int64_t rows, int64_t n,
                                      int64_t k, int64_t base_m, int64_t base_n, int64_t base_k, int64_t k_slices,
                                      int64_t sub_m) {
  if (plan == nullptr || chunks == nullptr || count <= 0 || rows < 0) return false;
  TilePlan one{};
  if (!make_tile_plan(&one, rows, n, k, base_m, base_n, base_k, k_slices, sub_m)) return false;
  int64_t m = 0, pad_m = 0, elems = 0, bytes = 0;
  if (!checked_mul(count, rows, &m) || !checked_mul(count, one.pad_m, &pad_m)) return false;
  if (!checked_mul(pad_m, one.pad_n, &elems) || !checked_mul(elems, 8, &bytes)) return false;
  if (!checked_mul(pad_m, one.pad_k, &elems) || !checked_mul(elems, 8, &bytes)) return false;
  chunks->count = count;
  chunks->rows = rows;
  chunks->m_tiles = one.m_tiles;
  one.m = m;
  one.m_tiles *= count;
  one.tiles = one.m_tiles * one.n_tiles;
  one.pad_m = pad_m;
  *plan = one;
  return true;
}

// Chunk of tile row mi.
GEMM_AR_FN int64_t chunk_of_tile_row(const RowChunks& c, int64_t mi) { return c.m_tiles > 0 ? mi / c.m_tiles : 0; }

// Tiles of one chunk. The plan numbers tiles row by row, so chunk g's tiles are the run
// [g * chunk_tile_count, (g + 1) * chunk_tile_count).
GEMM_AR_FN int64_t chunk_tile_count(const TilePlan& plan, const RowChunks& c) { return c.m_tiles * plan.n_tiles; }

// Tile row mi of the plan that is tile row i (< m_tiles) of chunk g.
GEMM_AR_FN int64_t chunk_tile_row(const RowChunks& c, int64_t g, int64_t i) { return g * c.m_tiles + i; }

// Plan tile id of tile t (numbered row by row inside the chunk, t < chunk_tile_count) of chunk g.
GEMM_AR_FN int64_t chunk_tile(const TilePlan& plan, const RowChunks& c, int64_t g, int64_t t) {
  return g * chunk_tile_count(plan, c) + t;
}

// Rows rank `rank` holds: its chunks g = rank, rank + world, ... one after another (0 for a rank outside world).
GEMM_AR_FN int64_t chunked_owner_rows(const RowChunks& c, int64_t world, int64_t rank) {
  return owned_tile_count(c.count, world, rank) * c.rows;
}

// First row of tile row mi in the M x N output (its padded position is mi * base_m).
GEMM_AR_FN int64_t chunked_tile_row0(const TilePlan& plan, const RowChunks& c, int64_t mi) {
  if (c.m_tiles <= 0) return 0;
  return (mi / c.m_tiles) * c.rows + (mi % c.m_tiles) * plan.base_m;
}

// First row of tile row mi among the rows of its chunk's rank, whose chunks g = rank, rank + world, ... are stored
// one after another (that rank's reduce-scatter output, or its shard of a).
GEMM_AR_FN int64_t chunked_owner_row0(const TilePlan& plan, const RowChunks& c, int64_t mi, int64_t world) {
  if (c.m_tiles <= 0 || world <= 0) return 0;
  return (mi / c.m_tiles) / world * c.rows + (mi % c.m_tiles) * plan.base_m;
}

// chunked_owner_row0 in a buffer that keeps each chunk's padding (m_tiles * base_m rows a chunk): where tile row
// mi sits in its rank's padded buffer of its chunks' tiles (the NPU reduce-scatter's reduced buffer).
GEMM_AR_FN int64_t chunked_owner_padded_row0(const TilePlan& plan, const RowChunks& c, int64_t mi, int64_t world) {
  if (c.m_tiles <= 0 || world <= 0) return 0;
  return ((mi / c.m_tiles) / world * c.m_tiles + mi % c.m_tiles) * plan.base_m;
}

// Valid rows of tile row mi: base_m except in each chunk's last tile row; 0 outside the grid.
GEMM_AR_FN int64_t chunked_tile_rows(const TilePlan& plan, const RowChunks& c, int64_t mi) {
  if (c.m_tiles <= 0 || mi < 0 || mi >= plan.m_tiles) return 0;
  const int64_t left = c.rows - (mi % c.m_tiles) * plan.base_m;
  if (left <= 0) return 0;
  return left < plan.base_m ? left : plan.base_m;
}

// Valid rows of stripe `stripe` of tile row mi; 0 when it lies wholly in the padding.
GEMM_AR_FN int64_t chunked_stripe_rows(const TilePlan& plan, const RowChunks& c, int64_t mi, int64_t stripe) {
  if (stripe < 0 || stripe >= plan.stripes) return 0;
  const int64_t left = chunked_tile_rows(plan, c, mi) - stripe * plan.sub_m;
  if (left <= 0) return 0;
  return left < plan.sub_m ? left : plan.sub_m;
}

// Ownership run (ownership.hpp) that gives every chunk's tiles to the chunk's rank.
GEMM_AR_FN int64_t chunk_ownership_run(const TilePlan& plan, const RowChunks& c) {
  return c.m_tiles * plan.n_tiles > 0 ? c.m_tiles * plan.n_tiles : 1;
}

}  // namespace gemm_ar
