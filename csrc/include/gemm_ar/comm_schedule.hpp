// How the Q comm blocks split the work: which compute queues each drains (reduce-scatter side), which
// owner-local subtiles each broadcasts (all-gather side), and the order in which peers are visited.
#pragma once
#include <cstdint>

#include "fn.hpp"

namespace gemm_ar {

// Comm block that drains the ready queue of compute block q: comm block c drains queues c, c+Q, c+2Q, ...
GEMM_AR_FN int64_t queue_comm_block(int64_t q, int64_t comm_blocks) { return q % comm_blocks; }

// How many of the compute_blocks queues comm block c drains.
GEMM_AR_FN int64_t comm_block_queue_count(int64_t c, int64_t compute_blocks, int64_t comm_blocks) {
  if (compute_blocks <= 0 || comm_blocks <= 0 || c < 0 || c >= comm_blocks) return 0;
  return compute_blocks / comm_blocks + (c < compute_blocks % comm_blocks ? 1 : 0);
}

// The j-th queue (compute block) comm block c drains.
GEMM_AR_FN int64_t comm_block_queue(int64_t c, int64_t j, int64_t comm_blocks) { return c + j * comm_blocks; }

// Comm block that all-gathers owner-local subtile l. Stripes are dealt in reverse (Q-1, Q-2, ..., 0), so the
// blocks that drain the most queues (the low ones) get the fewest all-gather subtiles.
GEMM_AR_FN int64_t ag_block_of(int64_t l, int64_t comm_blocks) { return comm_blocks - 1 - l % comm_blocks; }

// The j-th owner-local subtile comm block c all-gathers.
GEMM_AR_FN int64_t ag_subtile(int64_t c, int64_t j, int64_t comm_blocks) {
  return (comm_blocks - 1 - c) + j * comm_blocks;
}

// How many of the owned_subtiles owner-local subtiles comm block c all-gathers.
GEMM_AR_FN int64_t ag_subtile_count(int64_t c, int64_t owned_subtiles, int64_t comm_blocks) {
  if (owned_subtiles <= 0 || comm_blocks <= 0 || c < 0 || c >= comm_blocks) return 0;
  const int64_t first = comm_blocks - 1 - c;
  if (first >= owned_subtiles) return 0;
  return (owned_subtiles - 1 - first) / comm_blocks + 1;
}

// The i-th peer (i in [0, world-1)) that rank `me` visits for subtile l. Never `me`; for fixed (me, l) a
// bijection of [0, world-1) onto the other ranks, started at an offset that rotates with l so concurrent blocks
// spread over different destinations. -1 when there is no such peer (world <= 1 or i out of range).
GEMM_AR_FN int64_t rotated_peer(int64_t me, int64_t l, int64_t i, int64_t world) {
  if (world <= 1 || i < 0 || i >= world - 1) return -1;
  const int64_t others = world - 1;
  const int64_t shift = ((l % others) + others) % others;  // non-negative even for l < 0
  const int64_t step = 1 + (shift + i) % others;           // in [1, world-1]
  return (me + step) % world;
}

}  // namespace gemm_ar
