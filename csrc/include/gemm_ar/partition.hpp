// Balanced contiguous split of `items` work items over `blocks` workers: block b gets [begin, end), and the
// first items % blocks blocks get one item more than the rest.
#pragma once
#include <cstdint>

#include "fn.hpp"

namespace gemm_ar {

struct Range {
  int64_t begin, end;
};

// Empty range for items <= 0, blocks <= 0 or b outside [0, blocks).
GEMM_AR_FN Range block_range(int64_t items, int64_t blocks, int64_t b) {
  Range r{0, 0};
  if (items <= 0 || blocks <= 0 || b < 0 || b >= blocks) return r;
  const int64_t base = items / blocks;
  const int64_t extra = items % blocks;
  r.begin = b * base + (b < extra ? b : extra);
  r.end = r.begin + base + (b < extra ? 1 : 0);
  return r;
}

// The largest range any block gets: ceil(items / blocks); sizes per-block queues.
GEMM_AR_FN int64_t max_block_items(int64_t items, int64_t blocks) {
  if (items <= 0 || blocks <= 0) return 0;
  return (items + blocks - 1) / blocks;
}

}  // namespace gemm_ar
