// The reduce-scatter phase that gemm_allreduce's and gemm_reduce_scatter's comm kernels share
// (gemm_comm_kernel.cpp, sp_comm_kernel.cpp): an owner's comm block zeroes the owned subtiles it gathers in its
// reduced buffer and announces them (prepared[owner][block] in every window); a source adds a finished stripe into
// the owner's reduced buffer by atomic add only after seeing that announcement, then raises contrib[l][source] on
// the owner. What differs between the ops is ownership (round-robin tiles, or runs of a chunk's tiles) and where a
// stripe lives: the callers compute owner, owner-local subtile and addresses, this phase moves and flags.
#pragma once
#include <pto/pto-inst.hpp>

#include "comm_block.hpp"
#include "device_support.hpp"

namespace gemm_ar {
namespace device {

class ReduceScatterBlock : public CommBlockBase {
 protected:
  AICORE inline ReduceScatterBlock(const KernelArgs& args, int64_t block) : CommBlockBase(args, block) {}

  // In `owner`'s window: source `source` has added its part of owner-local subtile l.
  AICORE inline __gm__ uint32_t* contrib_flag(int32_t owner, int64_t l, int32_t source) const {
    return win_.at<uint32_t>(owner, contrib_flag_offset(args_.layout, l, source, world_));
  }

  // In my window: owner `owner`'s comm block `block` has zeroed (or published) its part for this call.
  AICORE inline __gm__ uint32_t* prepared_flag(int32_t owner, int64_t block) const {
    return win_.at<uint32_t>(me_, prepared_flag_offset(args_.layout, args_.epoch, owner, block, world_));
  }

  // prepared[me][c_] in every rank's window, mine last; the caller fences what it announces first.
  AICORE inline void announce_prepared() {
    for (int32_t i = 0; i < world_; ++i) {
      const int32_t peer = (me_ + 1 + i) % world_;
      raise_flag(win_.at<uint32_t>(peer, prepared_flag_offset(args_.layout, args_.epoch, me_, c_, world_)), tag_,
                 tag_high_);
    }
  }

  // A subtile of zeros in UB at kUbZeros, for zero_span; the vector pipe's fill is done before MTE3 stores it.
  template <typename T>
  AICORE inline void load_zeros() {
    SubTile<T> zeros(kSubM, kBaseN);
    TASSIGN(zeros, kUbZeros);
    TEXPANDS(zeros, static_cast<T>(0));
    set_event(PIPE_V, PIPE_MTE3, EVENT_ID0);
    wait_event(PIPE_V, PIPE_MTE3, EVENT_ID0);
  }

  // rows x cols of zeros at dst (ld pad_n), after load_zeros.
  template <typename T>
  AICORE inline void zero_span(__gm__ T* dst, int64_t rows, int64_t cols) {
    SubTile<T> view(static_cast<unsigned>(rows), static_cast<unsigned>(cols));
    TASSIGN(view, kUbZeros);
    auto to = nd_view<T>(dst, rows, cols, args_.plan.pad_n);
    store_tile(to, view);
    note_payload_store();
  }

  // Bounded wait for owner `owner`'s comm block ag_block_of(l) to have zeroed owner-local subtile l in this call.
  // `acquire_site`: the negative control that drops the acquire fence after the flag.
  AICORE inline bool wait_prepared(int32_t owner, int64_t l, int acquire_site) {
    const int64_t block = ag_block_of(l, args_.comm_blocks);
    __gm__ uint32_t* flag = prepared_flag(owner, block);
    const uint64_t start = now_us();
    const uint64_t timeout = args_.wait_timeout_us != 0 ? args_.wait_timeout_us : kDefaultWaitTimeoutUs;
    while (!flag_raised(flag, tag_, tag_high_)) {
      if (aborted(args_)) return false;
      if (now_us() - start > timeout) {
        report_error(args_, kErrTimeoutPrepare, owner, block, static_cast<int32_t>(c_), 1);
        return false;
      }
      idle_pause();
    }
    if (site_kept(acquire_site)) acquire_fence();
    return true;
  }

  // One stripe (rows x cols, ld pad_n) from this rank's partial `src` into owner `owner`'s reduced buffer at `dst`
  // by atomic add, once the owner announced subtile l; then contrib[l][me] on the owner. `unfenced_site`: the
  // negative control that drops the release fence between the payload and the flag. False when the call failed.
  template <typename T>
  AICORE inline bool add_stripe(int32_t owner, int64_t l, __gm__ T* src, __gm__ T* dst, int64_t rows, int64_t cols,
                                int acquire_site, int unfenced_site) {
    if (!wait_prepared(owner, l, acquire_site)) return false;
    const int64_t ld = args_.plan.pad_n;
    SubTile<T> tile(static_cast<unsigned>(rows), static_cast<unsigned>(cols));
    TASSIGN(tile, kUbMove);
    auto from = nd_view<T>(src, rows, cols, ld);
    TLOAD(tile, from);
    set_event(PIPE_MTE2, PIPE_MTE3, EVENT_ID0);
    wait_event(PIPE_MTE2, PIPE_MTE3, EVENT_ID0);
    auto to = nd_view<T>(dst, rows, cols, ld);
    note_guarded_access();  // the owner's prepared flag: its zeroing comes first
    store_tile<pto::AtomicType::AtomicAdd>(to, tile);
    note_payload_store();
    set_event(PIPE_MTE3, PIPE_MTE2, EVENT_ID0);
    wait_event(PIPE_MTE3, PIPE_MTE2, EVENT_ID0);
    if (negative_control() == kControlFlagStoredEarly) {  // the flag's words stored now, written back after
      const uint32_t words[4] = {tag_, tag_high_, ~tag_, ~tag_high_};
      for (int w = 0; w < 4; ++w) scalar_store<uint32_t>(contrib_flag(owner, l, me_) + w, words[w]);
    }
    if (site_kept(unfenced_site)) release_fence();
    raise_flag(contrib_flag(owner, l, me_), tag_, tag_high_);
    return true;
  }
};

}  // namespace device
}  // namespace gemm_ar
