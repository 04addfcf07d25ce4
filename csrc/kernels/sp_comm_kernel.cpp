// GemmRsCommKernel / AgGemmCommKernel (vector cores): the communication of the sequence-parallel ops
// (gemm_ar/sequence_parallel.hpp), with gemm_allreduce's flag discipline (128-bit tag flags on their own lines,
// release_fence before a flag, acquire_fence after one, bounded waits, error record, NaN over `out` on failure).
//
// Both: comm block 0 publishes the call signature in its own window and every block reads its peers' from theirs
// and compares (call_signature.hpp; the signature carries the op and its dim, so ranks calling different ops stop
// here) before anything moves: no block writes into a peer's window before it saw the peer's signature there (the
// peer may still be inside an HCCL collective until then). Before leaving, a block has seen prepared[owner][c] of
// every owner, so no write of this call into this rank's window is still on its way when the next call starts.
//
// Reduce-scatter (RS only, no all-gather): comm block c
//  1. zeroes the owner-local subtiles of this rank's chunk it copies out (ag_subtile(c, j, Q)) in its reduced
//     buffer, then sets prepared[me][c] in every window;
//  2. drains ready queues {c, c + Q, ...}: each stripe of a tile of chunk g goes by TSTORE<AtomicAdd> into rank
//     g's reduced buffer once g's prepared flag is seen, then contrib[l][me] is set there (l: owner-local subtile,
//     ownership in runs of a chunk's tiles);
//  3. copies each of its subtiles of this rank's chunk to `out` once every rank's contrib flag is up.
// Allgather: comm block c
//  1. publishes tile rows i = c, c + Q, ... of this rank's shard of a into its window (and into its gathered
//     buffer), then sets prepared[me][c] ("published") in every window;
//  2. pulls the same tile rows of every peer's shard (from me + 1 on) from the peer's window into its gathered
//     buffer once the peer's prepared[peer][c] is seen, and raises the row-ready flag of the plan's tile row for its
//     compute kernel; after the last one of a peer it sets consumed[me][c] in that peer's window;
//  3. drains ready queues {c, c + Q, ...}, copying every finished tile to its rows of `out`;
//  4. leaves only after consumed[peer][c] of every peer: nobody reads its shard any more, so the next call may
//     overwrite it.
#include <pto/pto-inst.hpp>

#include "comm_block.hpp"
#include "device_support.hpp"
#include "ready_queue.hpp"
#include "reduce_scatter_phase.hpp"
#include "remote_window.hpp"
#include "sp_kernel_entry.h"

namespace gemm_ar {
namespace device {
namespace {

// Stripe `stripe` of a plan tile: its tile row, where it starts in the tile row and in the columns, and its valid
// rows x cols (at most sub_m x base_n; rows 0 when it lies wholly in the chunk's padding).
struct Span {
  int64_t mi, row_in_tile, col0, rows, cols;
};

AICORE inline Span stripe_span(const TilePlan& p, const RowChunks& c, int64_t t, int64_t stripe) {
  const int64_t mi = tile_row(p, t);
  const int64_t ni = tile_col(p, t);
  return {mi, stripe * p.sub_m, ni * p.base_n, chunked_stripe_rows(p, c, mi, stripe), tile_cols(p, ni)};
}

// Attach, agree and the poison come from CommBlockBase (comm_block.hpp), the reduce-scatter's moves and flags from
// the phase it shares with gemm_allreduce (reduce_scatter_phase.hpp).
template <typename T>
class SpCommBlock : public ReduceScatterBlock {
 public:
  AICORE inline SpCommBlock(const KernelArgs& args, int64_t block, uint32_t op)
      : ReduceScatterBlock(args, block), op_(op) {}

  // NaN over all of `out`: this rank's chunk (reduce-scatter; one chunk per rank) or every chunk's rows
  // (allgather).
  AICORE inline void poison() { poison_rows<T>(op_ == kOpGemmReduceScatter ? args_.chunks.rows : args_.plan.m); }

  AICORE inline void init_call() {
    queues_.init(args_, c_, op_);
    run_ = chunk_ownership_run(args_.plan, args_.chunks);
    own_next_ = 0;
    own_seen_ = 0;
    pull_step_ = 1;
    pull_row_ = c_;
  }

  // Step 1 of either op.
  AICORE inline void prepare() {
    if (op_ == kOpGemmReduceScatter) {
      zero_own_chunk();
    } else {
      publish_shard();
    }
    // Zeros (reduce-scatter) or published rows (allgather) reach GM before the flag.
    if (site_kept(op_ == kOpGemmReduceScatter ? kControlRsZeroUnfenced : kControlAgPublishUnfenced)) release_fence();
    announce_prepared();
  }

  // Steps 2 and 3 (and 4): one polling loop, bounded by wait_timeout_us without progress. False when the call
  // failed (recorded by this block or by the one that failed first).
  AICORE inline bool run() {
    bool drained = queues_.done();
    uint64_t last_progress = now_us();
    const uint64_t timeout = args_.wait_timeout_us != 0 ? args_.wait_timeout_us : kDefaultWaitTimeoutUs;
    int32_t announced = 0;                                    // owners whose prepared[owner][c] flag I have seen
    int32_t consumed = op_ == kOpAllgatherGemm ? 0 : world_;  // peers seen done with my shard (allgather)
    if (consumed == me_) ++consumed;
    while (!drained || !own_done() || !pulls_done() || announced < world_ || consumed < world_) {
      bool progress = false;
      if (!drained) {
        const int64_t t = queues_.poll(args_, tag_, tag_high_);
        if (t == -2) {
          report_error(args_, kErrQueueCorrupt, -1, queues_.corrupt_item(), static_cast<int32_t>(c_), 1);
          return false;
        }
        if (t >= 0) {
          if (op_ == kOpGemmReduceScatter ? !reduce_scatter_tile(t) : !copy_out_tile(t)) return false;
          progress = true;
          drained = queues_.done();
        }
      }
      if (op_ == kOpGemmReduceScatter) {
        while (!own_done() && try_own_subtile()) progress = true;
      } else {
        while (!pulls_done() && try_pull()) progress = true;
        while (consumed < world_ && flag_raised(consumed_flag(consumed), tag_, tag_high_)) {
          if (++consumed == me_) ++consumed;
          progress = true;
        }
      }
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
        report_stall(drained, announced, consumed);
        return false;
      }
      idle_pause();
    }
    // The next call may overwrite my shard: the peers' reads of it (seen through consumed) come first.
    acquire_fence();
    return true;
  }

 private:
  // The span in rank `owner`'s reduced buffer: its chunks' tiles, padded (reduce-scatter).
  AICORE inline __gm__ T* reduced(int32_t owner, const Span& s) const {
    const int64_t row = chunked_owner_padded_row0(args_.plan, args_.chunks, s.mi, world_) + s.row_in_tile;
    return win_.at<T>(owner, args_.layout.reduced_offset) + row * args_.plan.pad_n + s.col0;
  }

  // The span in this rank's partial products: the plan's padded grid.
  AICORE inline __gm__ T* partial(const Span& s) const {
    const TilePlan& p = args_.plan;
    return gm_at<T>(args_.scratch, args_.layout.partial_offset) + (s.mi * p.base_m + s.row_in_tile) * p.pad_n + s.col0;
  }

  // The span's place in `out`: rows of this rank's chunk (reduce-scatter) or of every chunk (allgather).
  AICORE inline __gm__ T* out_at(const Span& s) const {
    const int64_t row0 = op_ == kOpGemmReduceScatter ? chunked_owner_row0(args_.plan, args_.chunks, s.mi, world_)
                                                     : chunked_tile_row0(args_.plan, args_.chunks, s.mi);
    return gm_at<T>(args_.out, 0) + (row0 + s.row_in_tile) * args_.ldo + s.col0;
  }

  // Tile row mi of a: in its rank's window (the rank's shard, ld k), or in this rank's gathered a (every shard,
  // ld k; AllgatherLayout).
  AICORE inline __gm__ T* shard_in_window(int32_t rank, int64_t mi) const {
    return win_.at<T>(rank, allgather_layout(args_.layout).shard_offset) +
           chunked_owner_row0(args_.plan, args_.chunks, mi, world_) * args_.plan.k;
  }
  AICORE inline __gm__ T* gathered(int64_t mi) const {
    return gm_at<T>(args_.scratch, allgather_layout(args_.layout).gathered_offset) +
           chunked_tile_row0(args_.plan, args_.chunks, mi) * args_.plan.k;
  }

  // In `rank`'s window: "source has pulled the tile rows comm block c handles of rank's shard".
  AICORE inline __gm__ uint32_t* consumed_flag(int32_t source, int32_t rank) const {
    return win_.at<uint32_t>(rank,
                             ag_consumed_flag_offset(allgather_layout(args_.layout), source, c_, args_.comm_blocks));
  }
  AICORE inline __gm__ uint32_t* consumed_flag(int32_t source) const { return consumed_flag(source, me_); }
  AICORE inline __gm__ uint32_t* row_ready_flag(int64_t mi) const {
    return win_.at<uint32_t>(me_, ag_row_ready_flag_offset(allgather_layout(args_.layout), mi));
  }

  // rows x cols from src (ld src_ld) to dst (ld dst_ld) and, if dst2 != nullptr, to dst2 (ld dst_ld) through UB.
  AICORE inline void move(__gm__ T* src, int64_t src_ld, __gm__ T* dst, __gm__ T* dst2, int64_t dst_ld, int64_t rows,
                          int64_t cols) {
    SubTile<T> tile(static_cast<unsigned>(rows), static_cast<unsigned>(cols));
    TASSIGN(tile, kUbMove);
    auto from = nd_view<T>(src, rows, cols, src_ld);
    TLOAD(tile, from);
    set_event(PIPE_MTE2, PIPE_MTE3, EVENT_ID0);
    wait_event(PIPE_MTE2, PIPE_MTE3, EVENT_ID0);
    auto to = nd_view<T>(dst, rows, cols, dst_ld);
    store_tile(to, tile);
    if (dst2 != nullptr) {
      auto to2 = nd_view<T>(dst2, rows, cols, dst_ld);
      store_tile(to2, tile);
    }
    if (site_kept(kControlMoveTileReused)) {  // the stores have read the tile before the next TLOAD refills it
      set_event(PIPE_MTE3, PIPE_MTE2, EVENT_ID0);
      wait_event(PIPE_MTE3, PIPE_MTE2, EVENT_ID0);
    }
  }

  // Rows [row0, row0 + rows) x all k columns, in sub_m x base_n pieces.
  AICORE inline void move_rows(__gm__ T* src, int64_t src_ld, __gm__ T* dst, __gm__ T* dst2, int64_t rows) {
    const int64_t k = args_.plan.k;
    for (int64_t r0 = 0; r0 < rows; r0 += kSubM) {
      for (int64_t c0 = 0; c0 < k; c0 += kBaseN) {
        const int64_t h = rows - r0 < kSubM ? rows - r0 : kSubM;
        const int64_t w = k - c0 < kBaseN ? k - c0 : kBaseN;
        move(src + r0 * src_ld + c0, src_ld, dst + r0 * k + c0, dst2 == nullptr ? nullptr : dst2 + r0 * k + c0, k, h,
             w);
      }
    }
  }

  // ---- reduce-scatter ----

  AICORE inline int64_t own_count() const {
    if (op_ != kOpGemmReduceScatter) return 0;
    const int64_t owned = run_owned_tile_count(args_.plan.tiles, world_, me_, run_) * args_.plan.stripes;
    return ag_subtile_count(c_, owned, args_.comm_blocks);
  }

  // Owner-local subtile l of this rank's chunk.
  AICORE inline Span own_span(int64_t l) const {
    const TilePlan& p = args_.plan;
    const int64_t t = run_subtile_tile(l, me_, world_, p.stripes, run_);
    return stripe_span(p, args_.chunks, t, subtile_stripe(l, p.stripes));
  }
  AICORE inline bool own_done() const { return own_next_ >= own_count(); }

  AICORE inline void zero_own_chunk() {
    load_zeros<T>();
    for (int64_t j = 0; j < own_count(); ++j) {
      const Span s = own_span(ag_subtile(c_, j, args_.comm_blocks));
      if (s.rows > 0) zero_span<T>(reduced(me_, s), s.rows, s.cols);
    }
  }

  // Plan tile t: every stripe into its chunk's rank's reduced buffer (ownership in runs of a chunk's tiles).
  AICORE inline bool reduce_scatter_tile(int64_t t) {
    const TilePlan& p = args_.plan;
    const int32_t owner = static_cast<int32_t>(run_owner_of(t, world_, run_));
    for (int64_t stripe = 0; stripe < p.stripes; ++stripe) {
      const Span s = stripe_span(p, args_.chunks, t, stripe);
      if (s.rows == 0) continue;  // all padding: nobody adds or copies it
      const int64_t l = run_local_subtile(t, stripe, world_, p.stripes, run_);
      if (!add_stripe<T>(owner, l, partial(s), reduced(owner, s), s.rows, s.cols, kControlRsPreparedAcquire,
                         kControlRsPayloadUnfenced)) {
        return false;
      }
    }
    return true;
  }

  // The next subtile of my chunk this block copies out, once every rank's contribution is in. Flags never go back
  // within a call, so each is read once when set (own_seen_ resumes).
  AICORE inline bool try_own_subtile() {
    const TilePlan& p = args_.plan;
    const int64_t l = ag_subtile(c_, own_next_, args_.comm_blocks);
    const Span s = own_span(l);
    if (s.rows != 0) {
      while (own_seen_ < world_ && flag_raised(contrib_flag(me_, l, own_seen_), tag_, tag_high_)) ++own_seen_;
      if (own_seen_ < world_) return false;
      if (site_kept(kControlRsContribAcquire)) acquire_fence();
      note_guarded_access();  // every contribution flag of this subtile
      move(reduced(me_, s), p.pad_n, out_at(s), nullptr, args_.ldo, s.rows, s.cols);
    }
    ++own_next_;
    own_seen_ = 0;
    return true;
  }

  // ---- allgather ----

  // Tile rows c, c + Q, ... of my shard: to my window (the peers pull them) and to my gathered buffer.
  AICORE inline void publish_shard() {
    const TilePlan& p = args_.plan;
    const RowChunks& chunks = args_.chunks;
    for (int64_t i = c_; i < chunks.m_tiles; i += args_.comm_blocks) {
      const int64_t mi = chunk_tile_row(chunks, me_, i);
      const int64_t row0 = chunked_owner_row0(p, chunks, mi, world_);  // in the caller's a: my shard alone
      move_rows(gm_at<T>(args_.a, 0) + row0 * args_.lda, args_.lda, shard_in_window(me_, mi), gathered(mi),
                chunked_tile_rows(p, chunks, mi));
      note_payload_store();
    }
  }

  AICORE inline bool pulls_done() const { return op_ != kOpAllgatherGemm || pull_step_ >= world_; }

  // The next tile row to pull (peer me + pull_step_, row pull_row_), once that peer has published it. After a
  // peer's last row (or when this block has none of its rows), tells the peer its shard is no longer read.
  AICORE inline bool try_pull() {
    const RowChunks& chunks = args_.chunks;
    const int32_t peer = (me_ + pull_step_) % world_;
    if (pull_row_ < chunks.m_tiles) {
      if (!flag_raised(prepared_flag(peer, c_), tag_, tag_high_)) return false;
      if (site_kept(kControlAgPublishedAcquire)) acquire_fence();
      const int64_t mi = chunk_tile_row(chunks, peer, pull_row_);
      note_guarded_access();  // the peer's published rows
      move_rows(shard_in_window(peer, mi), args_.plan.k, gathered(mi), nullptr,
                chunked_tile_rows(args_.plan, chunks, mi));
      note_payload_store();
      if (site_kept(kControlAgPullUnfenced)) release_fence();  // also ends my reads of the peer's window
      raise_flag(row_ready_flag(mi), tag_, tag_high_);
      pull_row_ += args_.comm_blocks;
      if (pull_row_ < chunks.m_tiles) return true;
    }
    raise_flag(consumed_flag(me_, peer), tag_, tag_high_);
    ++pull_step_;
    pull_row_ = c_;
    return true;
  }

  // Plan tile t of the product: every stripe to its rows of `out`.
  AICORE inline bool copy_out_tile(int64_t t) {
    const TilePlan& p = args_.plan;
    for (int64_t stripe = 0; stripe < p.stripes; ++stripe) {
      const Span s = stripe_span(p, args_.chunks, t, stripe);
      if (s.rows == 0) continue;
      move(partial(s), p.pad_n, out_at(s), nullptr, args_.ldo, s.rows, s.cols);
    }
    return true;
  }

  // Names what this block waits for, root causes first: a rank that never started the call, this rank's own
  // compute, then the peers' contributions (reduce-scatter) or their published rows and their reads of my shard.
  AICORE inline void report_stall(bool drained, int32_t announced, int32_t consumed) {
    const int32_t block = static_cast<int32_t>(c_);
    if (announced < world_) {
      report_error(args_, kErrTimeoutPrepare, announced, c_, block, 1);
      return;
    }
    if (!pulls_done()) {
      report_error(args_, kErrTimeoutPrepare, (me_ + pull_step_) % world_, c_, block, 1);
      return;
    }
    if (!drained) {
      report_error(args_, kErrTimeoutCompute, -1, queues_.first_pending(), block, 1);
      return;
    }
    if (!own_done()) {
      report_error(args_, kErrTimeoutReduce, own_seen_, ag_subtile(c_, own_next_, args_.comm_blocks), block, 1);
      return;
    }
    report_error(args_, kErrTimeoutConsumed, consumed, c_, block, 1);
  }

  const uint32_t op_;
  QueueCursor queues_;
  int64_t run_ = 1;        // ownership run: a chunk's tiles (row_chunks.hpp, chunk_ownership_run)
  int64_t own_next_ = 0;   // reduce-scatter: index (j) of the next subtile of my chunk to copy out
  int32_t own_seen_ = 0;   // its contribution flags seen so far
  int32_t pull_step_ = 1;  // allgather: pulling from peer me + pull_step_ (done at world)
  int64_t pull_row_ = 0;   // its next tile row
};

template <uint32_t DType>
AICORE inline void sp_comm_block_main(const KernelArgs& args, int64_t block, bool usable, uint32_t op) {
  SpCommBlock<typename ElemOf<DType>::type> comm(args, block, op);
  run_comm_block(comm, usable);
}

AICORE inline void sp_comm_main(__gm__ uint8_t* args_gm, uint32_t op) {
  KernelArgs args{};  // zeroed: g++ cannot follow the word-by-word load and warns of uninitialised fields
  load_kernel_args(args_gm, &args);
  const int64_t block = static_cast<int64_t>(get_block_idx());
  const int64_t launched = launched_block_count(args.comm_blocks);
  // Without a usable header this rank cannot even tell its peers; they time out waiting for its signature.
  if (!kernel_header_usable(args, launched, args.comm_blocks)) {
    if (block == 0) {
      report_error(args, kErrBadArgs, -1, -1, 0, 1);
      if (kernel_operands_usable(args, op)) {
        if (args.dtype == kDTypeBFloat16) {
          SpCommBlock<bfloat16_t>(args, 0, op).poison();
        } else {
          SpCommBlock<half>(args, 0, op).poison();
        }
      }
    }
    return;
  }
  if (block >= args.comm_blocks) return;
  const bool usable = kernel_args_usable(args, launched, args.comm_blocks, op);
  if (usable && args.dtype == kDTypeBFloat16) {
    sp_comm_block_main<kDTypeBFloat16>(args, block, usable, op);
  } else {
    sp_comm_block_main<kDTypeFloat16>(args, block, usable, op);
  }
}

}  // namespace
}  // namespace device
}  // namespace gemm_ar

__global__ AICORE void GemmRsCommKernel(__gm__ uint8_t* args_gm) {
  gemm_ar::device::sp_comm_main(args_gm, gemm_ar::kOpGemmReduceScatter);
}

__global__ AICORE void AgGemmCommKernel(__gm__ uint8_t* args_gm) {
  gemm_ar::device::sp_comm_main(args_gm, gemm_ar::kOpAllgatherGemm);
}

#if !defined(__CPU_SIM)
#include "sp_kernel_launch.h"

void gemm_ar::launch_rs_comm(uint32_t block_dim, void* stream, void* args_device) {
  GemmRsCommKernel<<<block_dim, nullptr, stream>>>(reinterpret_cast<__gm__ uint8_t*>(args_device));
}

void gemm_ar::launch_ag_comm(uint32_t block_dim, void* stream, void* args_device) {
  AgGemmCommKernel<<<block_dim, nullptr, stream>>>(reinterpret_cast<__gm__ uint8_t*>(args_device));
}
#endif
