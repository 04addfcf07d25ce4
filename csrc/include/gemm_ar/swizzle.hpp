// Row zig-zag walk over the tile grid: odd tile rows are visited right to left, so consecutive tiles share
// their B column panel at each row turn (docs/architecture.md §3.1).
#pragma once
#include <cstdint>

#include "fn.hpp"

namespace gemm_ar {

// Tile id visited at position `linear` of the walk (n_tiles > 0).
GEMM_AR_FN int64_t zigzag_tile(int64_t linear, int64_t n_tiles) {
  const int64_t row = linear / n_tiles;
  int64_t col = linear % n_tiles;
  if (row % 2 == 1) col = n_tiles - 1 - col;
  return row * n_tiles + col;
}

// Position in the walk of tile id t; the inverse of zigzag_tile (the mapping happens to be its own inverse).
GEMM_AR_FN int64_t zigzag_linear(int64_t t, int64_t n_tiles) {
  const int64_t row = t / n_tiles;
  int64_t col = t % n_tiles;
  if (row % 2 == 1) col = n_tiles - 1 - col;
  return row * n_tiles + col;
}

}  // namespace gemm_ar
