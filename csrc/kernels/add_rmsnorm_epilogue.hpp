// The add+RMSNorm epilogue of GemmCommKernel (docs/decisions/0011-add-rmsnorm-epilogue.md; gemm_ar/epilogue_args.hpp):
// once a row band is reduced on this rank, out = reduced + residual (rounded to the call dtype) and normed = out *
// rsqrt(mean(out^2) + eps) * weight, the row statistics in fp32.
//
// Who normalises what. A row band is one stripe of a tile row (sub_m rows) across all N columns; its subtiles
// belong to different owners and are finalised by different comm blocks, and a row's statistics need all of them.
// Every rank normalises its own copy of every band, from its own window's reduced buffer, which after the
// all-gather holds the same values on every rank: band b is done by comm block b % Q, which waits until each of
// the band's subtiles is final in this rank's window - for a subtile this rank owns, every source's contribution
// flag; for another owner's, the arrival flag of its all-gather copy. Those flags exist anyway (exact-tag, never
// reset, addressed to this rank and waited for by the gather list too), so the epilogue adds no flag, no counter
// (AICore has no scalar fetch-and-add on GM) and no communication, and the bands of every rank go through the same
// instructions on the same bytes: both outputs are bitwise identical across ranks.
//
// The decode variant (decode_comm_block.hpp) runs the same epilogue: there the window holds every source's partial of
// every tile (each rank pushes its own into its own window too), "tile t of the band is final" means
// pushed[t][source] of every source (the flags sit where the tiled layout has its contribution flags, tile t in
// place of owner-local subtile l), and pass 1 first sums the sources' partials in fp32 in rank order and rounds
// once to the call dtype - the all-reduce's result, bit for bit what the decode variant without the epilogue
// stores - before it adds the residual. M <= 64 is one band: comm block 0 normalises every row.
//
// Per band, chunks of kEpilogueRows rows; per chunk two passes over the band's column tiles (N may be far wider than
// the UB): pass 1 writes out = round(reduced + residual) and adds out^2 (fp32) into a per-element accumulator;
// then one row sum gives the statistics; pass 2 reads `out` back and writes normed. Per-row values are kept in
// row-major [rows x 8] tiles (one 32-byte block per row): A2/A3's vector ops reject column-major tiles for
// element-wise arithmetic, and TROWEXPANDMUL takes a row-major operand with 8 equal floats per row.
#pragma once
#include <pto/pto-inst.hpp>

#include "device_support.hpp"
#include "remote_window.hpp"

namespace gemm_ar {
namespace device {

constexpr int kEpilogueRows = 16;                           // rows per chunk
constexpr int kEpilogueCols = static_cast<int>(kNpuBaseN);  // one column tile per step
constexpr int kStatCols = 8;                                // one 32-byte block of fp32 per row

// The epilogue's UB, from `base` on (the comm kernel puts it after its own staging tiles).
struct EpilogueUb {
  static constexpr uint32_t kHalfTile = kEpilogueRows * kEpilogueCols * 2;
  static constexpr uint32_t kFloatTile = kEpilogueRows * kEpilogueCols * 4;
  static constexpr uint32_t kStat = kEpilogueRows * kStatCols * 4;
  static constexpr uint32_t kIn = 0;                                  // dtype: reduced, then out
  static constexpr uint32_t kAux = kIn + kHalfTile;                   // dtype: residual, then normed
  static constexpr uint32_t kX = kAux + kHalfTile;                    // fp32 working tile
  static constexpr uint32_t kY = kX + kFloatTile;                     // fp32: residual; the row sum's scratch
  static constexpr uint32_t kAcc = kY + kFloatTile;                   // fp32: sum of out^2 per element over the band
  static constexpr uint32_t kWeightIn = kAcc + kFloatTile;            // dtype [1 x cols]
  static constexpr uint32_t kWeight = kWeightIn + kEpilogueCols * 2;  // fp32 [1 x cols]
  static constexpr uint32_t kSum = kWeight + kEpilogueCols * 4;       // [rows x 8], column 0: the row sum
  static constexpr uint32_t kMoment = kSum + kStat;                   // [rows x 8]: mean(out^2) + eps, all 8 equal
  static constexpr uint32_t kRstd = kMoment + kStat;                  // [rows x 8]: rsqrt of it
  static constexpr uint32_t kOnes = kRstd + kStat;                    // TRSQRT's 32-byte scratch
  static constexpr uint32_t kBytes = kOnes + 32;
};

template <typename T>
class AddRmsNormEpilogue {
 public:
  using InTile = pto::Tile<pto::TileType::Vec, T, kEpilogueRows, kEpilogueCols, pto::BLayout::RowMajor, pto::DYNAMIC,
                           pto::DYNAMIC>;
  using FloatTile = pto::Tile<pto::TileType::Vec, float, kEpilogueRows, kEpilogueCols, pto::BLayout::RowMajor,
                              pto::DYNAMIC, pto::DYNAMIC>;
  using InRow = pto::Tile<pto::TileType::Vec, T, 1, kEpilogueCols, pto::BLayout::RowMajor, pto::DYNAMIC, pto::DYNAMIC>;
  using FloatRow =
      pto::Tile<pto::TileType::Vec, float, 1, kEpilogueCols, pto::BLayout::RowMajor, pto::DYNAMIC, pto::DYNAMIC>;
  using StatTile = pto::Tile<pto::TileType::Vec, float, kEpilogueRows, kStatCols, pto::BLayout::RowMajor, pto::DYNAMIC,
                             pto::DYNAMIC>;

  AICORE inline AddRmsNormEpilogue(const KernelArgs& args, int64_t block, uint32_t ub_base)
      : args_(args), e_(args.epilogue), c_(block), ub_(ub_base), decode_(args.variant == kVariantDecode) {}

  // Plan-dependent state; `win`: this call's windows (attached), tag/tag_high: this call's flag value.
  AICORE inline void init_call(const RemoteWindows* win, uint32_t tag, uint32_t tag_high) {
    win_ = win;
    tag_ = tag;
    tag_high_ = tag_high;
    const TilePlan& p = args_.plan;
    bands_ = e_.kind == kEpilogueAddRmsNorm ? p.m_tiles * p.stripes : 0;
    band_ = c_;
    col_ = 0;
    source_ = 0;
    skip_empty_bands();
  }

  AICORE inline bool pending() const { return band_ < bands_; }

  // Waits (without blocking) for the current band's subtiles; runs it once all are final. True on progress.
  AICORE inline bool poll() {
    if (!pending()) return false;
    bool progress = false;
    const TilePlan& p = args_.plan;
    if (negative_control() != kControlEpilogueNoWait) {
      while (col_ < p.n_tiles) {
        const int64_t t = band_tile(col_);
        if (waits_for_every_source(t)) {
          const int64_t l = flag_item(t);
          while (source_ < args_.world &&
                 flag_raised(contrib_flag(l, static_cast<int32_t>(source_)), tag_, tag_high_)) {
            ++source_;
            progress = true;
          }
          if (source_ < args_.world) return progress;
        } else if (!flag_raised(arrival_flag(t), tag_, tag_high_)) {
          return progress;
        }
        ++col_;
        source_ = 0;
        progress = true;
      }
    }
    // Every subtile of the band is final in this rank's window: no read of it may run ahead of the flags.
    if (site_kept(kControlEpilogueAcquire)) acquire_fence();
    run_band();
    band_ += args_.comm_blocks;
    col_ = 0;
    source_ = 0;
    skip_empty_bands();
    return true;
  }

  // The first flag the current band still waits for, as the comm kernel's stall report names it.
  AICORE inline void report_stall() const {
    const TilePlan& p = args_.plan;
    const int64_t t = band_tile(col_);
    const int32_t owner = static_cast<int32_t>(owner_of(t, args_.world));
    const int32_t block = static_cast<int32_t>(c_);
    if (waits_for_every_source(t)) {
      report_error(args_, kErrTimeoutReduce, static_cast<int32_t>(source_), flag_item(t), block, 1);
    } else {
      report_error(args_, kErrTimeoutGather, owner, t * p.stripes + band_stripe(), block, 1);
    }
  }

  // A failed call's poison (docs/decisions/0005-bounded-waits-and-failure-reporting.md) for the second output: NaN over
  // all of `normed`, after this block's own last store there.
  AICORE inline void poison() {
    if (e_.kind != kEpilogueAddRmsNorm || e_.normed == 0) return;
    pipe_barrier(PIPE_ALL);
    InTile nans(kEpilogueRows, kEpilogueCols);
    TASSIGN(nans, ub_ + EpilogueUb::kAux);
    TEXPANDS(nans, static_cast<T>(__builtin_nanf("")));
    set_event(PIPE_V, PIPE_MTE3, EVENT_ID2);
    wait_event(PIPE_V, PIPE_MTE3, EVENT_ID2);
    const TilePlan& p = args_.plan;
    for (int64_t row = 0; row < p.m; row += kEpilogueRows) {
      const int64_t rows = p.m - row < kEpilogueRows ? p.m - row : kEpilogueRows;
      for (int64_t ni = 0; ni < p.n_tiles; ++ni) {
        const int64_t cols = tile_cols(p, ni);
        InTile view(static_cast<unsigned>(rows), static_cast<unsigned>(cols));
        TASSIGN(view, ub_ + EpilogueUb::kAux);
        auto dst = nd_view<T>(gm_at<T>(e_.normed, 0) + row * e_.ld_normed + ni * p.base_n, rows, cols, e_.ld_normed);
        store_tile(dst, view);
      }
    }
    pipe_barrier(PIPE_ALL);
  }

 private:
  AICORE inline int64_t band_tile_row() const { return band_ / args_.plan.stripes; }
  AICORE inline int64_t band_stripe() const { return band_ % args_.plan.stripes; }
  AICORE inline int64_t band_tile(int64_t ni) const { return band_tile_row() * args_.plan.n_tiles + ni; }

  // Whether tile t of the band is final here once every source's flag is raised (a subtile this rank owns, or any
  // tile of the decode variant), rather than when its owner's all-gather copy arrived; and the flags' item.
  AICORE inline bool waits_for_every_source(int64_t t) const {
    return decode_ || static_cast<int32_t>(owner_of(t, args_.world)) == args_.rank;
  }
  AICORE inline int64_t flag_item(int64_t t) const {
    return decode_ ? t : local_subtile(t, band_stripe(), args_.world, args_.plan.stripes);
  }

  AICORE inline void skip_empty_bands() {
    while (band_ < bands_ && stripe_rows(args_.plan, band_tile_row(), band_stripe()) == 0) band_ += args_.comm_blocks;
  }

  AICORE inline __gm__ uint32_t* contrib_flag(int64_t l, int32_t source) const {
    return win_->at<uint32_t>(args_.rank, contrib_flag_offset(args_.layout, l, source, args_.world));
  }
  AICORE inline __gm__ uint32_t* arrival_flag(int64_t t) const {
    return win_->at<uint32_t>(args_.rank, arrival_flag_offset(args_.layout, t, band_stripe(), args_.plan.stripes));
  }

  // Pipe hand-overs inside one block: `to` starts only after `from`'s earlier work is done.
  template <pipe_t From, pipe_t To>
  AICORE inline static void hand_over() {
    set_event(From, To, EVENT_ID2);
    wait_event(From, To, EVENT_ID2);
  }

  AICORE inline void run_band() {
    const TilePlan& p = args_.plan;
    const int64_t band_row0 = band_tile_row() * p.base_m + band_stripe() * p.sub_m;  // padded row == output row
    const int64_t band_rows = stripe_rows(p, band_tile_row(), band_stripe());
    for (int64_t r0 = 0; r0 < band_rows; r0 += kEpilogueRows) {
      const int64_t rows = band_rows - r0 < kEpilogueRows ? band_rows - r0 : kEpilogueRows;
      run_chunk(band_row0 + r0, rows);
    }
  }

  // x = the reduced rows at `reduced` (rows x cols, row stride pad_n) in fp32, as the call dtype holds them; `in`
  // and `tmp` are scratch. Tiled: the window's reduced buffer. Decode: `reduced` is source 0's partial, source s's
  // lies s * m * pad_n further; their sum in fp32, in rank order, rounded once to the call dtype. The caller has
  // handed MTE2 over (the vector unit is done with `in`); on return the vector unit holds x and MTE2 is idle.
  AICORE inline void load_reduced(InTile& in, FloatTile& x, FloatTile& tmp, __gm__ T* reduced, int64_t rows,
                                  int64_t cols, int64_t ni) {
    const TilePlan& p = args_.plan;
    const int32_t sources = decode_ ? args_.world : 1;
    const int64_t t = band_tile(ni);
    for (int32_t k = 0; k < sources; ++k) {
      if (k > 0) hand_over<PIPE_V, PIPE_MTE2>();  // the vector unit is done with the last source's `in`
      const int64_t source = decode_ ? decode_summand(k, t, args_.rank, args_.world) : 0;
      auto src = nd_view<T>(reduced + source * p.m * p.pad_n, rows, cols, p.pad_n);
      note_guarded_access();  // the band's flags (poll)
      TLOAD(in, src);
      hand_over<PIPE_MTE2, PIPE_V>();
      TCVT(k == 0 ? x : tmp, in, pto::RoundMode::CAST_NONE);
      pipe_barrier(PIPE_V);
      if (k > 0) {
        TADD(x, x, tmp);
        pipe_barrier(PIPE_V);
      }
    }
    if (!decode_) return;
    TCVT(in, x, pto::RoundMode::CAST_RINT);  // the all-reduce's result in the call dtype
    pipe_barrier(PIPE_V);
    TCVT(x, in, pto::RoundMode::CAST_NONE);
    pipe_barrier(PIPE_V);
  }

  AICORE inline void run_chunk(int64_t row0, int64_t rows) {
    const TilePlan& p = args_.plan;
    const unsigned r = static_cast<unsigned>(rows);
    __gm__ T* reduced = win_->at<T>(args_.rank, args_.layout.reduced_offset) + row0 * p.pad_n;
    __gm__ T* out = gm_at<T>(args_.out, 0) + row0 * args_.ldo;
    __gm__ T* residual = gm_at<T>(e_.residual, 0) + row0 * e_.ld_residual;
    __gm__ T* normed = gm_at<T>(e_.normed, 0) + row0 * e_.ld_normed;
    __gm__ T* weight = gm_at<T>(e_.norm_weight, 0);

    FloatTile acc(kEpilogueRows, kEpilogueCols);
    TASSIGN(acc, ub_ + EpilogueUb::kAcc);
    hand_over<PIPE_MTE3, PIPE_V>();  // the previous chunk's stores have read their tiles
    TEXPANDS(acc, 0.0f);             // columns past a short last tile stay 0 in the row sum
    pipe_barrier(PIPE_V);

    // Pass 1: out = round(reduced + residual); acc += out^2.
    for (int64_t ni = 0; ni < p.n_tiles; ++ni) {
      const int64_t col0 = ni * p.base_n;
      const unsigned cols = static_cast<unsigned>(tile_cols(p, ni));
      InTile in(r, cols), aux(r, cols);
      FloatTile x(r, cols), y(r, cols), acc_view(r, cols);
      TASSIGN(in, ub_ + EpilogueUb::kIn);
      TASSIGN(aux, ub_ + EpilogueUb::kAux);
      TASSIGN(x, ub_ + EpilogueUb::kX);
      TASSIGN(y, ub_ + EpilogueUb::kY);
      TASSIGN(acc_view, ub_ + EpilogueUb::kAcc);
      hand_over<PIPE_V, PIPE_MTE2>();     // the vector unit is done with `in` / `aux`
      hand_over<PIPE_MTE3, PIPE_MTE2>();  // and so is the last store
      auto residual_src = nd_view<T>(residual + col0, rows, cols, e_.ld_residual);
      TLOAD(aux, residual_src);
      load_reduced(in, x, y, reduced + col0, rows, cols, ni);
      TCVT(y, aux, pto::RoundMode::CAST_NONE);
      pipe_barrier(PIPE_V);
      if (site_kept(kControlEpilogueNoResidual)) TADD(x, x, y);
      pipe_barrier(PIPE_V);
      TCVT(in, x, pto::RoundMode::CAST_RINT);  // the new residual stream, in the call dtype
      hand_over<PIPE_V, PIPE_MTE3>();
      auto out_dst = nd_view<T>(out + col0, rows, cols, args_.ldo);
      store_tile(out_dst, in);
      TCVT(x, in, pto::RoundMode::CAST_NONE);  // the statistics see the rounded values, as the reference does
      pipe_barrier(PIPE_V);
      TMUL(x, x, x);
      pipe_barrier(PIPE_V);
      TADD(acc_view, acc_view, x);
      pipe_barrier(PIPE_V);
    }

    // rstd = rsqrt(sum / N + eps), replicated over 8 columns per row for TROWEXPANDMUL.
    FloatTile acc_all(r, static_cast<unsigned>(p.n < kEpilogueCols ? p.n : kEpilogueCols));
    FloatTile scratch(r, kEpilogueCols);
    StatTile sum(r, 1), moment(r, kStatCols), rstd(r, kStatCols), ones(1, kStatCols);
    TASSIGN(acc_all, ub_ + EpilogueUb::kAcc);
    TASSIGN(scratch, ub_ + EpilogueUb::kY);
    TASSIGN(sum, ub_ + EpilogueUb::kSum);
    TASSIGN(moment, ub_ + EpilogueUb::kMoment);
    TASSIGN(rstd, ub_ + EpilogueUb::kRstd);
    TASSIGN(ones, ub_ + EpilogueUb::kOnes);
    TROWSUM(sum, acc_all, scratch);
    pipe_barrier(PIPE_V);
    TROWEXPAND(moment, sum);
    pipe_barrier(PIPE_V);
    TMULS(moment, moment, 1.0f / static_cast<float>(p.n));
    pipe_barrier(PIPE_V);
    TADDS(moment, moment, e_.eps);
    pipe_barrier(PIPE_V);
    TRSQRT(rstd, moment, ones);  // square root, then 1 / it (A3's TRECIP may not run in place, hence two tiles)
    pipe_barrier(PIPE_V);

    // Pass 2: normed = out * rstd * weight, from `out` as pass 1 stored it.
    for (int64_t ni = 0; ni < p.n_tiles; ++ni) {
      const int64_t col0 = ni * p.base_n;
      const unsigned cols = static_cast<unsigned>(tile_cols(p, ni));
      InTile in(r, cols), aux(r, cols);
      FloatTile x(r, cols);
      InRow w_in(1, cols);
      FloatRow w(1, cols);
      TASSIGN(in, ub_ + EpilogueUb::kIn);
      TASSIGN(aux, ub_ + EpilogueUb::kAux);
      TASSIGN(x, ub_ + EpilogueUb::kX);
      TASSIGN(w_in, ub_ + EpilogueUb::kWeightIn);
      TASSIGN(w, ub_ + EpilogueUb::kWeight);
      hand_over<PIPE_V, PIPE_MTE2>();
      hand_over<PIPE_MTE3, PIPE_MTE2>();  // pass 1's store of these columns is in GM before they are read back
      auto out_src = nd_view<T>(out + col0, rows, cols, args_.ldo);
      auto weight_src = nd_view<T>(weight + col0, 1, cols, cols);
      TLOAD(in, out_src);
      TLOAD(w_in, weight_src);
      hand_over<PIPE_MTE2, PIPE_V>();
      hand_over<PIPE_MTE3, PIPE_V>();  // the last store has read `aux`
      TCVT(x, in, pto::RoundMode::CAST_NONE);
      TCVT(w, w_in, pto::RoundMode::CAST_NONE);
      pipe_barrier(PIPE_V);
      TROWEXPANDMUL(x, x, rstd);
      pipe_barrier(PIPE_V);
      TCOLEXPANDMUL(x, x, w);
      pipe_barrier(PIPE_V);
      TCVT(aux, x, pto::RoundMode::CAST_RINT);
      hand_over<PIPE_V, PIPE_MTE3>();
      auto normed_dst = nd_view<T>(normed + col0, rows, cols, e_.ld_normed);
      store_tile(normed_dst, aux);
    }
  }

  const KernelArgs& args_;
  const EpilogueArgs& e_;
  const int64_t c_;
  const uint32_t ub_;
  const bool decode_;  // KernelArgs::variant == kVariantDecode
  const RemoteWindows* win_ = nullptr;
  uint32_t tag_ = 0, tag_high_ = 0;
  int64_t bands_ = 0;   // tile rows x stripes; 0 without an epilogue
  int64_t band_ = 0;    // the band this block runs next (c, c + Q, ...)
  int64_t col_ = 0;     // its first column tile not yet seen final
  int64_t source_ = 0;  // for an owned subtile at col_: contribution flags seen
};

}  // namespace device
}  // namespace gemm_ar
