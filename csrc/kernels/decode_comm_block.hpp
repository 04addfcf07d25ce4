// The decode variant of GemmCommKernel (KernelArgs::variant == kVariantDecode; docs/ascend.md, "Decode"): one-shot
// all-reduce of a small-M product (M <= kDecodeMaxM, one stripe of rows). The compute kernel is the tiled variant's
// (gemm_compute_kernel.cpp): it writes this rank's partial a @ b (+ bias on bias_rank) tile by tile into the scratch
// and publishes each tile in its ready queue. Comm block c of every rank then:
//  0. agrees on the call signature (CommBlockBase::agree): nothing is written into a peer's window before.
//  1. push: drains ready queues {c, c + Q, ...}; each tile's m rows go from the scratch into slot [me] of the
//     partials region of every peer's window (plain DMA stores, rotated peer order), then - after a release fence -
//     "pushed[t][me] = tag" is raised in each of those windows.
//  2. reduce: for every tile it pushed, once "pushed[t][source]" of every peer carries the tag in this rank's window
//     (acquire fence after the flags), it sums the world partials of the tile in fp32 in rank order 0, 1, ...,
//     world - 1 (its own from its scratch, the others from its window), rounds once to the call dtype and stores
//     the rows into `out`. Every rank sums the same bits in the same order: the results are bitwise identical.
//     The bias is in bias_rank's partial only (the cube adds it), so it is added once.
// With the add+RMSNorm epilogue (KernelArgs::epilogue; add_rmsnorm_epilogue.hpp) step 1 also stores the tile into
// slot [me] of this rank's own window and raises pushed[t][me] there, and step 2 is the epilogue's: a row's
// statistics need every column tile, which different blocks push, so the block that runs the row band (block 0:
// M <= 64 is one band) waits for pushed[t][source] of every tile and source and, per chunk of rows, sums the
// partials in rank order, rounds once (the all-reduce's result, as step 2 would store it), adds the residual and
// normalises. No block stores the plain sum into `out`.
// Nothing needs zeros (stores, no atomic adds), so there is no prepare phase and no prepared flag. Exit rule: every
// write of the call addressed to this rank is a peer's partial of some tile t and its flag pushed[t][peer]; tile t
// is reduced here by the block that drains its queue (with the epilogue: by the block that runs the band), which
// waits for all of its flags, so once every block has finished no write of the call is still on its way in. Entry
// rule: the signature agreement, as in the tiled variant. Every wait is bounded (wait_timeout_us without progress,
// or another block's failure); a block that gives up records why and stores NaN over `out` (CommBlockBase::
// poison_rows) and, with the epilogue, over `normed`.
#pragma once
#include <pto/pto-inst.hpp>

#include "add_rmsnorm_epilogue.hpp"
#include "comm_block.hpp"
#include "device_support.hpp"
#include "ready_queue.hpp"

namespace gemm_ar {
namespace device {

constexpr int kDecodeRows = 16;  // rows per reduction chunk (fp32 tiles of kDecodeRows x base_n in UB)

// The reduction's UB, after comm_block.hpp's staging and zeros subtiles.
struct DecodeUb {
  static constexpr uint32_t kIn = kUbZeros + kUbSubtileBytes;      // dtype: one source's rows, then the result
  static constexpr uint32_t kX = kIn + kDecodeRows * kBaseN * 2;   // fp32: that source's rows
  static constexpr uint32_t kAcc = kX + kDecodeRows * kBaseN * 4;  // fp32: the running sum, rank order
  static constexpr uint32_t kEnd = kAcc + kDecodeRows * kBaseN * 4;
};
static_assert(DecodeUb::kEnd <= pto::TMP_UB_OFFSET, "UB overflow");
// With the epilogue, the reduction's tiles are not used: the epilogue's (EpilogueUb) take their place.
static_assert(DecodeUb::kIn + EpilogueUb::kBytes <= pto::TMP_UB_OFFSET, "UB overflow");

template <typename T>
class DecodeCommBlock : public CommBlockBase {
 public:
  using InTile =
      pto::Tile<pto::TileType::Vec, T, kDecodeRows, kBaseN, pto::BLayout::RowMajor, pto::DYNAMIC, pto::DYNAMIC>;
  using FloatTile =
      pto::Tile<pto::TileType::Vec, float, kDecodeRows, kBaseN, pto::BLayout::RowMajor, pto::DYNAMIC, pto::DYNAMIC>;

  AICORE inline DecodeCommBlock(const KernelArgs& args, int64_t block)
      : CommBlockBase(args, block), epilogue_(args, block, DecodeUb::kIn) {}

  AICORE inline void init_call() {
    queues_.init(args_, c_);
    pushed_ = 0;
    reduced_ = 0;
    epilogue_.init_call(&win_, tag_, tag_high_);
  }

  // NaN over all of `out`, and of `normed` when the call has the epilogue.
  AICORE inline void poison() {
    poison_rows<T>(args_.plan.m);
    epilogue_.poison();
  }

  AICORE inline void prepare() {}  // stores, not atomic adds: nothing to zero, nothing to announce

  // False when the call failed (recorded by this block or by the one that failed first).
  AICORE inline bool run() {
    bool queues_done = queues_.done();
    uint64_t last_progress = now_us();
    const uint64_t timeout = args_.wait_timeout_us != 0 ? args_.wait_timeout_us : kDefaultWaitTimeoutUs;
    while (!queues_done || reduced_ < pushed_ || epilogue_.pending()) {
      bool progress = false;
      if (!queues_done) {
        const int64_t t = queues_.poll(args_, tag_, tag_high_);
        if (t == -2) {
          report_error(args_, kErrQueueCorrupt, -1, queues_.corrupt_item(), static_cast<int32_t>(c_), 1);
          return false;
        }
        if (t >= 0) {
          push(t);
          progress = true;
          queues_done = queues_.done();
        }
      }
      if (scan_pushed()) progress = true;
      if (epilogue_.pending() && epilogue_.poll()) progress = true;
      if (progress) {
        last_progress = now_us();
        continue;
      }
      if (aborted(args_)) return false;
      if (now_us() - last_progress > timeout) {
        report_stall(queues_done);
        return false;
      }
      idle_pause();
    }
    pipe_barrier(PIPE_ALL);
    return true;
  }

 private:
  AICORE inline bool has_epilogue() const { return args_.epilogue.kind != kEpilogueNone; }

  // In `rank`'s window: source `source`'s partial of tile t is there.
  AICORE inline __gm__ uint32_t* pushed_flag(int32_t rank, int64_t t, int32_t source) const {
    return win_.at<uint32_t>(rank, contrib_flag_offset(args_.layout, t, source, world_));
  }

  // Row 0, column col0 of source `source`'s partial in `rank`'s window.
  AICORE inline __gm__ T* pushed_rows(int32_t rank, int32_t source, int64_t col0) const {
    const TilePlan& p = args_.plan;
    return win_.at<T>(rank, args_.layout.reduced_offset) + source * p.m * p.pad_n + col0;
  }

  AICORE inline __gm__ T* own_rows(int64_t col0) const {
    return gm_at<T>(args_.scratch, args_.layout.partial_offset) + col0;
  }

  // Step 1: tile t's m rows from the scratch into every peer's window (with the epilogue: this rank's too), then the
  // pushed flags there.
  AICORE inline void push(int64_t t) {
    const TilePlan& p = args_.plan;
    const int64_t col0 = tile_col(p, t) * p.base_n;
    const int64_t cols = tile_cols(p, tile_col(p, t));
    const bool to_self = has_epilogue();
    if (!to_self) {  // else the epilogue reduces it, with the rest of its row band
      tiles_[pushed_] = static_cast<int32_t>(t);
      seen_[pushed_] = 0;
      ++pushed_;
    }
    if (world_ == 1 && !to_self) return;
    SubTile<T> tile(static_cast<unsigned>(p.m), static_cast<unsigned>(cols));
    TASSIGN(tile, kUbMove);
    auto src = nd_view<T>(own_rows(col0), p.m, cols, p.pad_n);
    note_guarded_access();  // the tile's ready-queue flag (QueueCursor::poll fenced after it)
    TLOAD(tile, src);
    set_event(PIPE_MTE2, PIPE_MTE3, EVENT_ID1);
    wait_event(PIPE_MTE2, PIPE_MTE3, EVENT_ID1);
    for (int32_t i = 0; i + 1 < world_; ++i) {
      const int32_t peer = static_cast<int32_t>(rotated_peer(me_, t, i, world_));
      auto dst = nd_view<T>(pushed_rows(peer, me_, col0), p.m, cols, p.pad_n);
      store_tile(dst, tile);
      note_payload_store();
    }
    if (to_self) {
      auto dst = nd_view<T>(pushed_rows(me_, me_, col0), p.m, cols, p.pad_n);
      store_tile(dst, tile);
      note_payload_store();
    }
    set_event(PIPE_MTE3, PIPE_MTE2, EVENT_ID1);
    wait_event(PIPE_MTE3, PIPE_MTE2, EVENT_ID1);
    if (site_kept(kControlDecodePushUnfenced)) release_fence();  // the partial in the peers' GM before the flags
    for (int32_t i = 0; i + 1 < world_; ++i) {
      const int32_t peer = static_cast<int32_t>(rotated_peer(me_, t, i, world_));
      if (negative_control() == kControlDecodeFlagUnflushed) {
        store_flag_words(pushed_flag(peer, t, me_));
      } else {
        raise_flag(pushed_flag(peer, t, me_), tag_, tag_high_);
      }
    }
    if (to_self) raise_flag(pushed_flag(me_, t, me_), tag_, tag_high_);
  }

  // Simulator-only negative controls of the pushed flags; never reached in a device build (negative_control() is 0).
  // The flag's words stored without the write-back raise_flag ends with (kControlDecodeFlagUnflushed).
  AICORE inline void store_flag_words(__gm__ uint32_t* flag) {
    scalar_store<uint32_t>(flag, tag_);
    scalar_store<uint32_t>(flag + 1, tag_high_);
    scalar_store<uint32_t>(flag + 2, ~tag_);
    scalar_store<uint32_t>(flag + 3, ~tag_high_);
  }

  // Whether source `source`'s partial of tile t is in this rank's window: flag_raised (invalidate, then the words);
  // under kControlDecodeFlagStale the words come from this core's cached copy of the line.
  AICORE inline bool pushed_seen(int64_t t, int32_t source) {
    __gm__ uint32_t* flag = pushed_flag(me_, t, source);
    if (negative_control() != kControlDecodeFlagStale) return flag_raised(flag, tag_, tag_high_);
    const bool raised = scalar_load<uint32_t>(flag) == tag_ && scalar_load<uint32_t>(flag + 1) == tag_high_ &&
                        scalar_load<uint32_t>(flag + 2) == ~tag_ && scalar_load<uint32_t>(flag + 3) == ~tag_high_;
#if defined(__CPU_SIM)
    if (raised) sim_cache::acquire_pending() = true;
#endif
    return raised;
  }

  // Step 2 for every pushed tile not reduced yet whose peers' partials are all here. True on progress.
  AICORE inline bool scan_pushed() {
    bool progress = false;
    for (int32_t i = 0; i < pushed_; ++i) {
      if (seen_[i] > world_) continue;  // reduced
      const int64_t t = tiles_[i];
      // Flags never go back within a call: resume where the last pass stopped, so each is read once when set.
      while (negative_control() != kControlDecodeNoWait && seen_[i] < world_ &&
             (seen_[i] == me_ || pushed_seen(t, seen_[i]))) {
        ++seen_[i];
        progress = true;
      }
      if (negative_control() != kControlDecodeNoWait && seen_[i] < world_) continue;
      if (site_kept(kControlDecodePushedAcquire)) acquire_fence();  // no partial read runs ahead of its flag
      reduce(t);
      seen_[i] = world_ + 1;
      ++reduced_;
      progress = true;
    }
    return progress;
  }

  // The rows of source `source`'s partial of the tile at col0, row0 on.
  AICORE inline __gm__ T* source_rows(int32_t source, int64_t col0, int64_t row0) const {
    const int64_t pad_n = args_.plan.pad_n;
    return (source == me_ ? own_rows(col0) : pushed_rows(me_, source, col0)) + row0 * pad_n;
  }

  // Pipe hand-overs inside this block: `To` starts only after `From`'s earlier work is done.
  template <pipe_t From, pipe_t To>
  AICORE inline static void hand_over() {
    set_event(From, To, EVENT_ID2);
    wait_event(From, To, EVENT_ID2);
  }

  // out[0:m, tile t's columns] = round(sum over ranks, in rank order, of their partials in fp32).
  AICORE inline void reduce(int64_t t) {
    const TilePlan& p = args_.plan;
    const int64_t col0 = tile_col(p, t) * p.base_n;
    const unsigned cols = static_cast<unsigned>(tile_cols(p, tile_col(p, t)));
    for (int64_t row0 = 0; row0 < p.m; row0 += kDecodeRows) {
      const unsigned rows = static_cast<unsigned>(p.m - row0 < kDecodeRows ? p.m - row0 : kDecodeRows);
      InTile in(rows, cols);
      FloatTile x(rows, cols), acc(rows, cols);
      TASSIGN(in, DecodeUb::kIn);
      TASSIGN(x, DecodeUb::kX);
      TASSIGN(acc, DecodeUb::kAcc);
      for (int32_t k = 0; k < world_; ++k) {
        const int32_t source = decode_summand(k, t, me_, world_);
        hand_over<PIPE_V, PIPE_MTE2>();     // the vector unit is done with `in`
        hand_over<PIPE_MTE3, PIPE_MTE2>();  // and so is the last store to `out`
        auto src = nd_view<T>(source_rows(source, col0, row0), rows, cols, p.pad_n);
        note_guarded_access();  // the source's pushed flag (its ready-queue flag for this rank's own)
        TLOAD(in, src);
        hand_over<PIPE_MTE2, PIPE_V>();
        if (k == 0) {
          TCVT(acc, in, pto::RoundMode::CAST_NONE);
        } else {
          TCVT(x, in, pto::RoundMode::CAST_NONE);
          pipe_barrier(PIPE_V);
          TADD(acc, acc, x);
        }
        pipe_barrier(PIPE_V);
      }
      TCVT(in, acc, pto::RoundMode::CAST_RINT);
      hand_over<PIPE_V, PIPE_MTE3>();
      auto dst = nd_view<T>(gm_at<T>(args_.out, 0) + row0 * args_.ldo + col0, rows, cols, args_.ldo);
      store_tile(dst, in);
    }
    hand_over<PIPE_MTE3, PIPE_MTE2>();  // the last store has read `in` before anything reuses the UB
  }

  // Names what this block waits for: its own compute kernel first, then the first missing partial.
  AICORE inline void report_stall(bool queues_done) {
    const int32_t block = static_cast<int32_t>(c_);
    if (!queues_done) {
      report_error(args_, kErrTimeoutCompute, -1, queues_.first_pending(), block, 1);
      return;
    }
    if (epilogue_.pending()) {
      epilogue_.report_stall();  // a source's partial of a tile of its row band
      return;
    }
    for (int32_t i = 0; i < pushed_; ++i) {
      if (seen_[i] > world_) continue;
      const int32_t source = seen_[i];
      report_error(args_, kErrTimeoutReduce, source < world_ ? source : -1, tiles_[i], block, 1);
      return;
    }
    report_error(args_, kErrTimeoutReduce, -1, -1, block, 1);
  }

  QueueCursor queues_;
  AddRmsNormEpilogue<T> epilogue_;  // idle unless the call carries one
  int32_t pushed_ = 0;              // tiles pushed that this block reduces (tiles_[0, pushed_); none with the epilogue)
  int32_t reduced_ = 0;             // of those, reduced
  int32_t tiles_[kDecodeMaxTiles];  // the tiles this block pushed, in order
  int32_t seen_[kDecodeMaxTiles];   // per pushed tile: sources seen in rank order; world + 1 once reduced
};

}  // namespace device
}  // namespace gemm_ar
