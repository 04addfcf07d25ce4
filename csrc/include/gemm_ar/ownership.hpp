// Which rank owns (reduces and broadcasts) each tile, and the owner-local numbering of its subtiles used for
// the ready/final counters (design.md §5).
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

}  // namespace gemm_ar
