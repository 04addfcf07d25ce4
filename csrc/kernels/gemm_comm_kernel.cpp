// GemmCommKernel (vector cores): reduce-scatter every finished tile into its owner's window, all-gather each fully
// reduced subtile to every rank, and write this rank's result into `out` (docs/architecture.md §3.2 steps 3-5, §3.4
// "Push").
//
// Comm block c of every rank:
//  0. agree: block 0 publishes this rank's call signature in its own window, and every block reads every peer's
//     signature of this call from that peer's window and compares (call_signature.hpp). A difference, or a rank
//     that rejected its arguments, stops every rank here. Nothing is written into a peer's window before: until its
//     signature is seen there, the peer may still be inside an HCCL collective that uses its window.
//  1. prepare: zeroes the owner-local subtiles it gathers for this rank (ag_subtile(c, j, Q)) in this rank's
//     reduced buffer, then sets "prepared[me][c] = tag" in every rank's window. Sources add into an owner's subtile
//     l only after seeing prepared[owner][ag_block_of(l)]: the buffer needs zeros before atomic adds, and bytes
//     from an earlier call or from HCCL's own collectives may be anywhere in the window.
//  2. reduce-scatter: drains ready queues {c, c + Q, ...}; each tile's stripes go by TSTORE<AtomicAdd> into the
//     owner's window, then "contrib[l][me] = tag" is set on the owner.
//  3. gather and copy out, one ordered list of items (j, owner) for j = 0, 1, ...: for owner == me it waits until
//     every source's contrib flag carries the tag, then stores the subtile to `out` and to every peer (rotated
//     order), then sets "arrival[t][stripe] = tag" there; for another owner it waits for that arrival flag and
//     copies the subtile from its own window to `out`. A 64-item window of the list is polled so out-of-order
//     readiness does not stall it, and every rank's block c walks the same list, so the earliest unfinished item
//     anywhere can always finish: no cycle of waits.
//  3b. with the add+RMSNorm epilogue (KernelArgs::epilogue, add_rmsnorm_epilogue.hpp) the gather writes nothing to
//     `out`: block c waits for every subtile of row bands c, c + Q, ... to be final in this rank's window and
//     writes both outputs of the band (out = reduced + residual, normed), so a row's statistics see all of it.
//  4. before leaving, it waits to have seen prepared[owner][c] of every owner, even those it did not need, so no
//     write of this call is still on its way into this rank's window when the next call (maybe another layout) or
//     an HCCL collective starts; every other flag addressed to this rank is waited for anyway.
// Every wait is bounded: no progress for wait_timeout_us, or another block's failure, ends the kernel with the
// reason in the ErrorRecord. Flags are exact-tag (64-bit tag and its complement), per (subtile, source) / per
// (owner, block) / per subtile, so nothing is reset between calls and shapes may vary (see kernel_args.hpp).
// A call that fails after its arguments were found usable leaves NaN in `out` (every block that gives up stores NaN
// over all of `out` after its own last store there), so a failure cannot pass for a result.
// KernelArgs::variant == kVariantDecode (small M) runs decode_comm_block.hpp's one-shot steps instead of 1-4 (with
// the same add+RMSNorm epilogue as 3b when the call carries one).
#include <pto/pto-inst.hpp>

#include "add_rmsnorm_epilogue.hpp"
#include "comm_block.hpp"
#include "decode_comm_block.hpp"
#include "device_support.hpp"
#include "kernel_entry.h"
#include "ready_queue.hpp"
#include "reduce_scatter_phase.hpp"
#include "remote_window.hpp"

namespace gemm_ar {
namespace device {
namespace {

constexpr int kListWindow = 64;  // items of the gather list polled at once (one bit each)

// The add+RMSNorm epilogue's tiles (EpilogueUb) follow comm_block.hpp's staging and zeros subtiles.
constexpr uint32_t kUbEpilogue = kUbZeros + kUbSubtileBytes;
// pto-isa keeps [TMP_UB_OFFSET, 192 KiB) for its own scratch (some conversions and broadcasts use it).
static_assert(kUbEpilogue + EpilogueUb::kBytes <= pto::TMP_UB_OFFSET, "UB overflow");

// Where a subtile lives in the padded pad_m x pad_n buffers and how much of it is real.
struct SubtileSpan {
  int64_t tile, stripe, row0, col0, rows, cols;
};

AICORE inline SubtileSpan subtile_span(const TilePlan& p, int64_t t, int64_t stripe) {
  SubtileSpan s;
  const int64_t mi = tile_row(p, t);
  const int64_t ni = tile_col(p, t);
  s.tile = t;
  s.stripe = stripe;
  s.row0 = mi * p.base_m + stripe * p.sub_m;
  s.col0 = ni * p.base_n;
  s.rows = stripe_rows(p, mi, stripe);
  s.cols = tile_cols(p, ni);
  return s;
}

// Step 0 (attach, agree) and the poison come from CommBlockBase (comm_block.hpp), steps 1 and 2's moves and flags
// from the reduce-scatter phase it shares with gemm_reduce_scatter (reduce_scatter_phase.hpp).
template <typename T>
class CommBlock : public ReduceScatterBlock {
 public:
  AICORE inline CommBlock(const KernelArgs& args, int64_t block)
      : ReduceScatterBlock(args, block), epilogue_(args, block, kUbEpilogue) {}

  // The plan-dependent state; only for a call whose arguments were found usable.
  AICORE inline void init_call() {
    queues_.init(args_, c_);
    const TilePlan& p = args_.plan;
    int64_t most = 0;
    for (int32_t o = 0; o < world_; ++o) {
      const int64_t n = ag_subtile_count(c_, owned_subtile_count(p.tiles, world_, o, p.stripes), args_.comm_blocks);
      most = n > most ? n : most;
    }
    list_len_ = most * world_;
    list_base_ = 0;
    list_done_ = 0;
    for (int k = 0; k < kListWindow; ++k) sources_seen_[k] = 0;
    epilogue_.init_call(&win_, tag_, tag_high_);
  }

  // docs/decisions/0005-bounded-waits-and-failure-reporting.md: NaN over every element of `out` (all of it: every rank
  // writes the whole result), and of `normed` when the call has the epilogue.
  AICORE inline void poison() {
    poison_rows<T>(args_.plan.m);
    epilogue_.poison();
  }

  AICORE inline void prepare() {
    load_zeros<T>();
    const int64_t mine =
        ag_subtile_count(c_, owned_subtile_count(args_.plan.tiles, world_, me_, args_.plan.stripes), args_.comm_blocks);
    for (int64_t j = 0; j < mine; ++j) {
      const int64_t l = ag_subtile(c_, j, args_.comm_blocks);
      const SubtileSpan s = span_of(l, me_);
      if (s.rows > 0) zero_span<T>(reduced(me_, s), s.rows, s.cols);
    }
    release_fence();
    announce_prepared();
  }

  // False when the call failed (recorded by this block or by the one that failed first).
  AICORE inline bool run() {
    bool rs_done = queues_.done();
    uint64_t last_progress = now_us();
    const uint64_t timeout = args_.wait_timeout_us != 0 ? args_.wait_timeout_us : kDefaultWaitTimeoutUs;
    int32_t announced = 0;  // owners whose prepared[owner][c] flag I have seen
    while (!rs_done || list_base_ < list_len_ || announced < world_ || epilogue_.pending()) {
      bool progress = false;
      if (!rs_done) {
        const int64_t t = queues_.poll(args_, tag_, tag_high_);
        if (t == -2) {
          report_error(args_, kErrQueueCorrupt, -1, queues_.corrupt_item(), static_cast<int32_t>(c_), 1);
          return false;
        }
        if (t >= 0) {
          if (!reduce_scatter_tile(t)) return false;
          progress = true;
          rs_done = queues_.done();
        }
      }
      if (list_base_ < list_len_ && scan_list()) progress = true;
      if (epilogue_.pending() && epilogue_.poll()) progress = true;
      // Before leaving the call, see every owner's "prepared" flag of my column, even those I never needed: then no
      // write of this call into my window is still in flight when the next call - whose layout may put data where
      // these flags were - starts. Every other remote write of the call is already waited for.
      while (announced < world_ && flag_raised(prepared_flag(announced, c_), tag_, tag_high_)) {
        ++announced;
        progress = true;
      }
      if (progress) {
        last_progress = now_us();
        continue;
      }
      if (aborted(args_)) return false;
      if (now_us() - last_progress > timeout) {
        report_stall(rs_done);
        return false;
      }
      idle_pause();
    }
    pipe_barrier(PIPE_ALL);
    return true;
  }

 private:
  AICORE inline bool has_epilogue() const { return args_.epilogue.kind != kEpilogueNone; }

  AICORE inline SubtileSpan span_of(int64_t l, int32_t owner) const {
    const TilePlan& p = args_.plan;
    return subtile_span(p, subtile_tile(l, owner, world_, p.stripes), subtile_stripe(l, p.stripes));
  }

  AICORE inline __gm__ T* reduced(int32_t rank, const SubtileSpan& s) const {
    return win_.at<T>(rank, args_.layout.reduced_offset) + s.row0 * args_.plan.pad_n + s.col0;
  }

  AICORE inline __gm__ uint32_t* arrival_flag(int32_t rank, const SubtileSpan& s) const {
    return win_.at<uint32_t>(rank, arrival_flag_offset(args_.layout, s.tile, s.stripe, args_.plan.stripes));
  }

  // Every stripe of tile t from the partial buffer into the owner's reduced buffer (round-robin ownership).
  AICORE inline bool reduce_scatter_tile(int64_t t) {
    const TilePlan& p = args_.plan;
    const int32_t owner = static_cast<int32_t>(owner_of(t, world_));
    __gm__ T* partial = gm_at<T>(args_.scratch, args_.layout.partial_offset);
    for (int64_t stripe = 0; stripe < p.stripes; ++stripe) {
      const SubtileSpan s = subtile_span(p, t, stripe);
      if (s.rows == 0) continue;  // all padding: nobody adds, gathers or copies it
      const int64_t l = local_subtile(t, stripe, world_, p.stripes);
      if (!add_stripe<T>(owner, l, partial + s.row0 * p.pad_n + s.col0, reduced(owner, s), s.rows, s.cols,
                         kControlPreparedAcquire, kControlPayloadUnfenced)) {
        return false;
      }
    }
    return true;
  }

  // Item i of the gather list: (j = i / world, owner = i % world). True once it is finished (or is empty).
  AICORE inline bool try_item(int64_t i) {
    const TilePlan& p = args_.plan;
    const int64_t j = i / world_;
    const int32_t owner = static_cast<int32_t>(i % world_);
    if (j >= ag_subtile_count(c_, owned_subtile_count(p.tiles, world_, owner, p.stripes), args_.comm_blocks)) {
      return true;
    }
    const int64_t l = ag_subtile(c_, j, args_.comm_blocks);
    const SubtileSpan s = span_of(l, owner);
    if (s.rows == 0) return true;
    if (owner == me_) {
      // Flags never go back within a call: resume where the last pass stopped, so each is read once when set.
      int32_t& seen = sources_seen_[i % kListWindow];
      while (seen < world_ && flag_raised(contrib_flag(me_, l, seen), tag_, tag_high_)) ++seen;
      if (seen < world_) return false;
      if (site_kept(kControlContribAcquire)) acquire_fence();
      gather(l, s);
    } else {
      if (!flag_raised(arrival_flag(me_, s), tag_, tag_high_)) return false;
      if (site_kept(kControlArrivalAcquire)) acquire_fence();
      if (!has_epilogue()) copy_out(s);  // else the epilogue reads it from the window with the rest of its band
    }
    return true;
  }

  // One pass over the polled part of the list; slides it past finished items.
  AICORE inline bool scan_list() {
    bool progress = false;
    for (int k = 0; k < kListWindow; ++k) {
      const int64_t i = list_base_ + k;
      if (i >= list_len_) break;
      const uint64_t bit = 1ull << k;
      if ((list_done_ & bit) != 0) continue;
      if (try_item(i)) {
        list_done_ |= bit;
        sources_seen_[i % kListWindow] = 0;  // the slot's next item, i + kListWindow, starts from scratch
        progress = true;
      }
    }
    while (list_base_ < list_len_ && (list_done_ & 1ull) != 0) {
      list_done_ >>= 1;
      ++list_base_;
    }
    return progress;
  }

  // A fully reduced subtile of mine: to `out`, then to every peer's window, then their arrival flags.
  AICORE inline void gather(int64_t l, const SubtileSpan& s) {
    const int64_t pad_n = args_.plan.pad_n;
    SubTile<T> tile(static_cast<unsigned>(s.rows), static_cast<unsigned>(s.cols));
    TASSIGN(tile, kUbMove);
    auto src = nd_view<T>(reduced(me_, s), s.rows, s.cols, pad_n);
    note_guarded_access();  // every contribution flag of this subtile
    TLOAD(tile, src);
    set_event(PIPE_MTE2, PIPE_MTE3, EVENT_ID1);
    wait_event(PIPE_MTE2, PIPE_MTE3, EVENT_ID1);
    if (!has_epilogue()) {  // else the epilogue writes `out` (reduced + residual)
      auto out = nd_view<T>(gm_at<T>(args_.out, 0) + s.row0 * args_.ldo + s.col0, s.rows, s.cols, args_.ldo);
      store_tile(out, tile);
    }
    for (int32_t i = 0; i + 1 < world_; ++i) {
      const int32_t peer = static_cast<int32_t>(rotated_peer(me_, l, i, world_));
      auto dst = nd_view<T>(win_.remote(reduced(me_, s), peer), s.rows, s.cols, pad_n);
      store_tile(dst, tile);
      note_payload_store();
    }
    set_event(PIPE_MTE3, PIPE_MTE2, EVENT_ID1);
    wait_event(PIPE_MTE3, PIPE_MTE2, EVENT_ID1);
    release_fence();
    for (int32_t i = 0; i + 1 < world_; ++i) {
      const int32_t peer = static_cast<int32_t>(rotated_peer(me_, l, i, world_));
      raise_flag(arrival_flag(peer, s), tag_, tag_high_);
    }
  }

  // A subtile another owner delivered into my window: to `out`.
  AICORE inline void copy_out(const SubtileSpan& s) {
    SubTile<T> tile(static_cast<unsigned>(s.rows), static_cast<unsigned>(s.cols));
    TASSIGN(tile, kUbMove);
    auto src = nd_view<T>(reduced(me_, s), s.rows, s.cols, args_.plan.pad_n);
    note_guarded_access();  // the owner's arrival flag
    TLOAD(tile, src);
    set_event(PIPE_MTE2, PIPE_MTE3, EVENT_ID1);
    wait_event(PIPE_MTE2, PIPE_MTE3, EVENT_ID1);
    auto out = nd_view<T>(gm_at<T>(args_.out, 0) + s.row0 * args_.ldo + s.col0, s.rows, s.cols, args_.ldo);
    store_tile(out, tile);
    set_event(PIPE_MTE3, PIPE_MTE2, EVENT_ID1);
    wait_event(PIPE_MTE3, PIPE_MTE2, EVENT_ID1);
  }

  // Names what this block is waiting for, root causes first: a rank that never announced this call (dead or not
  // launched; waits on everyone else would cascade from it), then this rank's own compute, then missing
  // contributions to my subtiles, then deliveries from other owners.
  AICORE inline void report_stall(bool rs_done) {
    const int32_t block = static_cast<int32_t>(c_);
    for (int32_t o = 0; o < world_; ++o) {
      for (int64_t cb = 0; cb < args_.comm_blocks; ++cb) {
        if (!flag_raised(prepared_flag(o, cb), tag_, tag_high_)) {
          report_error(args_, kErrTimeoutPrepare, o, cb, block, 1);
          return;
        }
      }
    }
    if (!rs_done) {
      report_error(args_, kErrTimeoutCompute, -1, queues_.first_pending(), block, 1);
      return;
    }
    for (int k = 0; k < kListWindow; ++k) {
      const int64_t i = list_base_ + k;
      if (i >= list_len_) break;
      if ((list_done_ & (1ull << k)) != 0) continue;
      const int32_t owner = static_cast<int32_t>(i % world_);
      const int64_t l = ag_subtile(c_, i / world_, args_.comm_blocks);
      const SubtileSpan s = span_of(l, owner);
      if (owner == me_) {
        for (int32_t src = 0; src < world_; ++src) {
          if (!flag_raised(contrib_flag(me_, l, src), tag_, tag_high_)) {
            report_error(args_, kErrTimeoutReduce, src, l, block, 1);
            return;
          }
        }
      } else {
        report_error(args_, kErrTimeoutGather, owner, s.tile * args_.plan.stripes + s.stripe, block, 1);
        return;
      }
    }
    if (list_base_ >= list_len_ && epilogue_.pending()) {
      epilogue_.report_stall();  // only the epilogue still waits: for a subtile of its row band
      return;
    }
    report_error(args_, kErrTimeoutGather, -1, list_base_, block, 1);
  }

  QueueCursor queues_;
  int64_t list_len_ = 0;
  int64_t list_base_ = 0;
  uint64_t list_done_ = 0;             // bit k: item list_base_ + k is finished
  int32_t sources_seen_[kListWindow];  // for my own items, by item index mod kListWindow: contrib flags seen
  AddRmsNormEpilogue<T> epilogue_;     // idle unless the call carries one
};

// `usable`: kernel_args_usable() passed (a signature-only call never moves data and has nothing to poison).
// A call whose header is unusable but whose operands are (e.g. no device context): `out` is still known, so it is
// poisoned rather than left as it was (docs/decisions/0005-bounded-waits-and-failure-reporting.md).
template <uint32_t DType>
AICORE inline void poison_only(const KernelArgs& args) {
  CommBlock<typename ElemOf<DType>::type> comm(args, 0);
  comm.poison();
}

// The decode variant (decode_comm_block.hpp) only for arguments found usable: a signature-only call carries no plan.
template <uint32_t DType>
AICORE inline void comm_block_main(const KernelArgs& args, int64_t block, bool usable) {
  if (usable && args.variant == kVariantDecode) {
    DecodeCommBlock<typename ElemOf<DType>::type> comm(args, block);
    run_comm_block(comm, usable);
    return;
  }
  CommBlock<typename ElemOf<DType>::type> comm(args, block);
  run_comm_block(comm, usable);
}

}  // namespace
}  // namespace device
}  // namespace gemm_ar

__global__ AICORE void GemmCommKernel(__gm__ uint8_t* args_gm) {
  using namespace gemm_ar;
  KernelArgs args;
  device::load_kernel_args(args_gm, &args);
  const int64_t block = static_cast<int64_t>(get_block_idx());
  const int64_t launched = device::launched_block_count(args.comm_blocks);
  // Without a usable header this rank cannot even tell its peers; they time out waiting for its signature.
  if (!device::kernel_header_usable(args, launched, args.comm_blocks)) {
    if (block == 0) {
      device::report_error(args, kErrBadArgs, -1, -1, 0, 1);
      if (device::kernel_operands_usable(args)) {
        if (args.dtype == kDTypeBFloat16) {
          device::poison_only<kDTypeBFloat16>(args);
        } else {
          device::poison_only<kDTypeFloat16>(args);
        }
      }
    }
    return;
  }
  if (block >= args.comm_blocks) return;
  const bool usable = device::kernel_args_usable(args, launched, args.comm_blocks);
  if (usable && args.dtype == kDTypeBFloat16) {
    device::comm_block_main<kDTypeBFloat16>(args, block, usable);
  } else {
    device::comm_block_main<kDTypeFloat16>(args, block, usable);
  }
}

#if !defined(__CPU_SIM)
#include "kernel_launch.h"

void gemm_ar::launch_gemm_comm(uint32_t block_dim, void* stream, void* args_device) {
  GemmCommKernel<<<block_dim, nullptr, stream>>>(reinterpret_cast<__gm__ uint8_t*>(args_device));
}
#endif
