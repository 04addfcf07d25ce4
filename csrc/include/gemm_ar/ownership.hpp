// Which rank owns (reduces and broadcasts) each tile, and the owner-local numbering of its subtiles used for
// the ready/final counters (docs/architecture.md §3.1).
#pragma once
#include <cstdint>

#include "fn.hpp"

namespace gemm_ar {

// Tiles are dealt round-robin over the ranks.
GEMM_AR_FN int64_t owner_of(int64_t t, int64_t world) { return t % world; }

// How many of the tiles [0, tiles) rank `rank` owns.
GEMM_AR_FN int64_t owned_tile_count(int64_t tiles, int64_t world, int64_t rank) {
  if (tiles <= 0 || world <= 0 || rank < 0 || rank >= world) return 0;
  return tiles / world + (rank < tiles % world ? 1 : 0);
}

// The most tiles any rank owns (rank 0's count); sizes the per-rank counter arrays identically everywhere.
GEMM_AR_FN int64_t max_owned_tile_count(int64_t tiles, int64_t world) {
  if (tiles <= 0 || world <= 0) return 0;
  return (tiles + world - 1) / world;
}

// Owner-local subtile id of stripe `stripe` of tile t on its owner.
GEMM_AR_FN int64_t local_subtile(int64_t t, int64_t stripe, int64_t world, int64_t stripes) {
  return (t / world) * stripes + stripe;
}

// Tile of owner-local subtile l on rank `owner`.
GEMM_AR_FN int64_t subtile_tile(int64_t l, int64_t owner, int64_t world, int64_t stripes) {
  return (l / stripes) * world + owner;
}

// Stripe of owner-local subtile l.
GEMM_AR_FN int64_t subtile_stripe(int64_t l, int64_t stripes) { return l % stripes; }

GEMM_AR_FN int64_t owned_subtile_count(int64_t tiles, int64_t world, int64_t rank, int64_t stripes) {
  if (stripes <= 0) return 0;
  return owned_tile_count(tiles, world, rank) * stripes;
}

GEMM_AR_FN int64_t max_owned_subtile_count(int64_t tiles, int64_t world, int64_t stripes) {
  if (stripes <= 0) return 0;
  return max_owned_tile_count(tiles, world) * stripes;
}

// The same deal in runs of `run` consecutive tiles: run r goes to rank r % world. Run 1 is the round-robin rule
// above; the reduce-scatter makes a run of every row chunk's tiles (row_chunks.hpp), so that the rank whose
// output chunk it is reduces it. Owner-local ids number an owner's tiles in tile order, as above.
GEMM_AR_FN int64_t run_owner_of(int64_t t, int64_t world, int64_t run) { return (t / run) % world; }

GEMM_AR_FN int64_t run_owned_tile_count(int64_t tiles, int64_t world, int64_t rank, int64_t run) {
  if (tiles <= 0 || world <= 0 || run <= 0 || rank < 0 || rank >= world) return 0;
  const int64_t round = run * world;
  int64_t extra = tiles % round - rank * run;
  extra = extra < 0 ? 0 : (extra > run ? run : extra);
  return tiles / round * run + extra;
}

GEMM_AR_FN int64_t run_max_owned_subtile_count(int64_t tiles, int64_t world, int64_t stripes, int64_t run) {
  if (stripes <= 0) return 0;
  return run_owned_tile_count(tiles, world, 0, run) * stripes;  // rank 0 owns the most
}

GEMM_AR_FN int64_t run_local_subtile(int64_t t, int64_t stripe, int64_t world, int64_t stripes, int64_t run) {
  return ((t / run) / world * run + t % run) * stripes + stripe;
}

GEMM_AR_FN int64_t run_subtile_tile(int64_t l, int64_t owner, int64_t world, int64_t stripes, int64_t run) {
  const int64_t local_tile = l / stripes;
  return ((local_tile / run) * world + owner) * run + local_tile % run;
}

}  // namespace gemm_ar
