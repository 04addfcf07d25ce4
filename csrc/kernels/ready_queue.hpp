// The single-producer single-consumer ready queue between one compute block (cube core) and the comm block that
// drains it (vector core), in the rank's scratch memory.
//
// Slot j = {tile id, ~id, 2 spare words, flag} (32 bytes, 2 slots per cache line): the producer writes the id of
// its j-th finished tile and flushes it, then (after a release fence that pushed the tile itself to GM) raises the
// slot's flag with the call's signal tag. The tag plays the role of the count: the consumer takes slot j once it
// carries this call's tag, so slots never need resetting - slots of an earlier call (whatever its shape) or garbage
// in reused memory hold another value. The producer's walk (its balanced range of linear indices, zig-zag ordered)
// is known to the consumer too, which checks the id against it: a mismatch is re-read a few times, then reported,
// never silently reduced.
#pragma once
#include "device_support.hpp"

namespace gemm_ar {
namespace device {

// Tile id of the j-th tile published by compute block `block`.
AICORE inline int64_t queue_tile(const TilePlan& plan, int64_t compute_blocks, int64_t block, int64_t j) {
  const Range range = block_range(plan.tiles, compute_blocks, block);
  return zigzag_tile(range.begin + j, plan.n_tiles);
}

AICORE inline int64_t queue_length(const TilePlan& plan, int64_t compute_blocks, int64_t block) {
  const Range range = block_range(plan.tiles, compute_blocks, block);
  return range.end - range.begin;
}

// Words 0-1 of the slot: the tile id and its complement; words 4-7: the flag.
AICORE inline __gm__ uint32_t* queue_slot(const KernelArgs& args, int64_t block, int64_t j) {
  return gm_at<uint32_t>(args.scratch, queue_slot_offset(args.layout, block, j));
}

// Producer side: call after the tile's TSTORE was issued. The first fence waits for the FIXPIPE store and pushes it
// to GM. The id is flushed from its own address: the flag's flush starts 16 bytes higher and, dcci covering only up to
// the next line boundary, would leave the id in this core's cache (docs/decisions/0007-npu-scalar-cache-discipline.md).
// The second fence orders the id's write-back before the flag.
AICORE inline void queue_publish(const KernelArgs& args, int64_t block, int64_t j, int64_t tile) {
  release_fence();
  __gm__ uint32_t* slot = queue_slot(args, block, j);
  // No stale copy of the line may be written back over what follows.
  if (site_kept(kControlQueueNotDropped)) flush_line(slot);
  scalar_store<uint32_t>(slot, static_cast<uint32_t>(tile));
  scalar_store<uint32_t>(slot + 1, ~static_cast<uint32_t>(tile));
  if (negative_control() != kControlQueueFlush) flush_line(slot);
  release_fence();
  raise_flag(slot + 4, signal_tag(args.epoch), signal_tag_high(args.epoch));
}

// The id of a slot whose flag was seen; -1 when its two words disagree (not yet written back, or garbage).
AICORE inline int64_t queue_read_id(__gm__ uint32_t* slot) {
  if (site_kept(kControlQueueIdStale)) flush_line(slot);
  note_guarded_access();  // the id is what the slot's flag published
  const uint32_t id = scalar_load<uint32_t>(slot);
  return scalar_load<uint32_t>(slot + 1) == ~id ? static_cast<int64_t>(id) : -1;
}

constexpr int kQueueIdRereads = 4;  // a mismatching id is read again this often before it counts as corrupt

// Consumer side: every queue {c, c + Q, ...} of one comm block, each drained in order.
class QueueCursor {
 public:
  // sp_op: 0 for gemm_allreduce's walk, else the OpKind whose walk the producers follow (sequence_parallel.hpp).
  AICORE inline void init(const KernelArgs& args, int64_t comm_block, uint32_t sp_op = 0) {
    sp_op_ = sp_op;
    count_ = static_cast<int32_t>(comm_block_queue_count(comm_block, args.compute_blocks, args.comm_blocks));
    for (int32_t k = 0; k < count_; ++k) {
      const int64_t q = comm_block_queue(comm_block, k, args.comm_blocks);
      queue_[k] = static_cast<int32_t>(q);
      head_[k] = 0;
      length_[k] = static_cast<int32_t>(sp_op == 0 ? queue_length(args.plan, args.compute_blocks, q)
                                                   : sp_block_item_count(args.plan, args.compute_blocks, q));
    }
    next_ = 0;
  }

  // The next published tile of any of my queues (round robin), -1 when none is ready now, or -2 when a slot
  // carried an id the producer's walk does not have there (corrupt_item() says which).
  AICORE inline int64_t poll(const KernelArgs& args, uint32_t tag, uint32_t tag_high) {
    for (int32_t i = 0; i < count_; ++i) {
      const int32_t k = (next_ + i) % count_;
      if (head_[k] >= length_[k]) continue;
      __gm__ uint32_t* slot = queue_slot(args, queue_[k], head_[k]);
      if (!flag_raised(slot + 4, tag, tag_high)) continue;
      if (site_kept(kControlQueueAcquire)) acquire_fence();
      const int64_t expected = sp_op_ == 0 ? queue_tile(args.plan, args.compute_blocks, queue_[k], head_[k])
                                           : sp_block_item(args.plan, args.chunks, args.rank, sp_op_,
                                                           args.compute_blocks, queue_[k], head_[k]);
      int64_t id = queue_read_id(slot);
      for (int attempt = 1; id != expected && attempt < kQueueIdRereads; ++attempt) {
        idle_pause();
        id = queue_read_id(slot);
      }
      if (id != expected) {
        corrupt_ = (static_cast<int64_t>(queue_[k]) << 32) | head_[k];
        return -2;
      }
      ++head_[k];
      next_ = (k + 1) % count_;
      return expected;
    }
    return -1;
  }

  AICORE inline int64_t corrupt_item() const { return corrupt_; }

  AICORE inline bool done() const {
    for (int32_t k = 0; k < count_; ++k) {
      if (head_[k] < length_[k]) return false;
    }
    return true;
  }

  // For error reports: the first queue still waiting and its slot, as queue * 2^32 + slot.
  AICORE inline int64_t first_pending() const {
    for (int32_t k = 0; k < count_; ++k) {
      if (head_[k] < length_[k]) return (static_cast<int64_t>(queue_[k]) << 32) | head_[k];
    }
    return -1;
  }

 private:
  int32_t queue_[kMaxComputeBlocks];
  int32_t head_[kMaxComputeBlocks];
  int32_t length_[kMaxComputeBlocks];
  int32_t count_ = 0;
  int32_t next_ = 0;
  uint32_t sp_op_ = 0;
  int64_t corrupt_ = -1;
};

}  // namespace device
}  // namespace gemm_ar
