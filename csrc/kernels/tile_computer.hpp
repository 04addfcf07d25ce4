// The cube-core tile product shared by the compute kernels (gemm_compute_kernel.cpp, sp_compute_kernel.cpp):
// one base_m x base_n tile of a @ b (+ bias) from the operands KernelArgs names into the scratch's padded partial
// buffer, at the tile's padded place (tile row mi at row mi * base_m). The plan may be row-chunked
// (row_chunks.hpp): a tile row's rows of a start at chunked_tile_row0, and it has chunked_tile_rows of them.
// Per tile, K is consumed in panels of k_step = 4 * base_k: one TLOAD of an A panel (128 x 256) and a B panel
// (256 x 256) into L1 (double-buffered), then four TEXTRACT slices into L0A/L0B (double-buffered) feeding
// TMATMUL/TMATMUL_ACC into the fp32 accumulator. A partial panel (K tail, or an M/N edge tile) is zero-filled in
// L1 first: zeros in the K tail keep garbage out of every sum; rows/cols past M/N only feed padding that is never
// read. The FIXPIPE casts fp32 to the output dtype on TSTORE.
#pragma once
#include <pto/pto-inst.hpp>

#include "device_support.hpp"

namespace gemm_ar {
namespace device {
constexpr int kBaseM = static_cast<int>(kNpuBaseM);
constexpr int kBaseK = static_cast<int>(kNpuBaseK);
constexpr int kSlices = static_cast<int>(kNpuKSlices);
constexpr int kStepK = kBaseK * kSlices;

// L1 map (512 KB): two A panels, two B panels, the bias row.
constexpr uint32_t kL1APanelBytes = kBaseM * kStepK * 2;
constexpr uint32_t kL1BPanelBytes = kStepK * kBaseN * 2;
constexpr uint32_t kL1A0 = 0;
constexpr uint32_t kL1A1 = kL1A0 + kL1APanelBytes;
constexpr uint32_t kL1B0 = kL1A1 + kL1APanelBytes;
constexpr uint32_t kL1B1 = kL1B0 + kL1BPanelBytes;
constexpr uint32_t kL1Bias = kL1B1 + kL1BPanelBytes;
static_assert(kL1Bias + kBaseN * sizeof(float) <= 512 * 1024, "L1 overflow");

using pto::BLayout;
using pto::DYNAMIC;
using pto::SLayout;
using pto::TileType;

// Tile types of one (dtype, b layout) instantiation. Each L1 panel has two views of the same bytes: a dynamic one
// sized to what TLOAD really reads, and a full one that the extracts slice.
template <typename T, uint32_t BLayoutCode>
struct CubeTiles {
  // A panel: NZ (fractal rows of 16 x C0), from row-major a.
  using APanel = pto::Tile<TileType::Mat, T, kBaseM, kStepK, BLayout::ColMajor, kBaseM, kStepK, SLayout::RowMajor, 512>;
  using APanelLoad =
      pto::Tile<TileType::Mat, T, kBaseM, kStepK, BLayout::ColMajor, DYNAMIC, DYNAMIC, SLayout::RowMajor, 512>;
  // B panel: ZN from a transposed weight (DN in GM), NZ from a row-major [K, N] b; TEXTRACT transposes the latter.
  static constexpr bool kTransposed = BLayoutCode == kBTransposed;
  static constexpr BLayout kBOuter = kTransposed ? BLayout::RowMajor : BLayout::ColMajor;
  static constexpr SLayout kBInner = kTransposed ? SLayout::ColMajor : SLayout::RowMajor;
  using BPanel = pto::Tile<TileType::Mat, T, kStepK, kBaseN, kBOuter, kStepK, kBaseN, kBInner, 512>;
  using BPanelLoad = pto::Tile<TileType::Mat, T, kStepK, kBaseN, kBOuter, DYNAMIC, DYNAMIC, kBInner, 512>;

  using Left = pto::TileLeft<T, kBaseM, kBaseK, kBaseM, kBaseK>;
  using Right = pto::TileRight<T, kBaseK, kBaseN, kBaseK, kBaseN>;
  using Acc = pto::TileAcc<float, kBaseM, kBaseN, kBaseM, kBaseN>;

  using BiasRow = pto::Tile<TileType::Mat, float, 1, kBaseN, BLayout::RowMajor, 1, kBaseN>;
  using BiasTable = pto::Tile<TileType::Bias, float, 1, kBaseN, BLayout::RowMajor, 1, kBaseN>;
};

// Where the rows of a that one tile row multiplies are: row row0 + i at a + ((row0 + i) * lda) elements.
struct ARows {
  uint64_t a;
  int64_t lda;
  int64_t row0;
};

template <typename T, uint32_t BLayoutCode>
class TileComputer {
  using Tiles = CubeTiles<T, BLayoutCode>;

 public:
  AICORE inline explicit TileComputer(const KernelArgs& args) : args_(args) {
    TASSIGN(a_panel_[0], kL1A0);
    TASSIGN(a_panel_[1], kL1A1);
    TASSIGN(b_panel_[0], kL1B0);
    TASSIGN(b_panel_[1], kL1B1);
    TASSIGN(bias_row_, kL1Bias);
    TASSIGN(left_[0], 0x0);
    TASSIGN(left_[1], kBaseM * kBaseK * sizeof(T));
    TASSIGN(right_[0], 0x0);
    TASSIGN(right_[1], kBaseK * kBaseN * sizeof(T));
    TASSIGN(acc_, 0x0);
    TASSIGN(bias_table_, 0x0);
  }

  // Computes tile (mi, ni) from KernelArgs' a (the tile row's rows of the output are its rows of a).
  AICORE inline void run(int64_t mi, int64_t ni, bool add_bias) {
    run(mi, ni, add_bias, ARows{args_.a, args_.lda, chunked_tile_row0(args_.plan, args_.chunks, mi)});
  }

  // Computes tile (mi, ni) from the rows of a at `src` into the partial buffer; returns after the TSTORE was issued
  // (not completed).
  AICORE inline void run(int64_t mi, int64_t ni, bool add_bias, const ARows& src) {
    const TilePlan& p = args_.plan;
    const int64_t row0 = mi * p.base_m;
    const int64_t col0 = ni * p.base_n;
    const int64_t rows = chunked_tile_rows(p, args_.chunks, mi);
    const int64_t cols = tile_cols(p, ni);
    const int64_t slices = ceil_div(p.k, p.base_k);

    if (add_bias) load_bias(col0);

    // Both L1 panel buffers and both L0 buffers start free.
    set_event(PIPE_MTE1, PIPE_MTE2, EVENT_ID0);
    set_event(PIPE_MTE1, PIPE_MTE2, EVENT_ID1);
    set_event(PIPE_M, PIPE_MTE1, EVENT_ID0);
    set_event(PIPE_M, PIPE_MTE1, EVENT_ID1);

    for (int64_t s = 0; s < slices; ++s) {
      const int64_t panel = s / kSlices;
      const int64_t in_panel = s % kSlices;
      const int buf = static_cast<int>(panel & 1);
      const event_t panel_ev = buf == 0 ? EVENT_ID0 : EVENT_ID1;
      const int64_t panel_slices =
          (slices - panel * kSlices) < kSlices ? (slices - panel * kSlices) : static_cast<int64_t>(kSlices);
      if (in_panel == 0) {
        wait_event(PIPE_MTE1, PIPE_MTE2, panel_ev);
        load_panel(buf, src, rows, col0, cols, panel * kStepK);
        set_event(PIPE_MTE2, PIPE_MTE1, panel_ev);
      }

      const int l0 = static_cast<int>(s & 1);
      const event_t l0_ev = l0 == 0 ? EVENT_ID0 : EVENT_ID1;
      wait_event(PIPE_M, PIPE_MTE1, l0_ev);
      if (in_panel == 0) wait_event(PIPE_MTE2, PIPE_MTE1, panel_ev);
      TEXTRACT(left_[l0], a_panel_[buf], 0, static_cast<uint16_t>(in_panel * kBaseK));
      TEXTRACT(right_[l0], b_panel_[buf], static_cast<uint16_t>(in_panel * kBaseK), 0);
      if (in_panel == panel_slices - 1) set_event(PIPE_MTE1, PIPE_MTE2, panel_ev);

      set_event(PIPE_MTE1, PIPE_M, l0_ev);
      wait_event(PIPE_MTE1, PIPE_M, l0_ev);
      if (s == 0 && add_bias) {
        TMATMUL_BIAS(acc_, left_[l0], right_[l0], bias_table_);
      } else if (s == 0) {
        TMATMUL(acc_, left_[l0], right_[l0]);
      } else {
        TMATMUL_ACC(acc_, acc_, left_[l0], right_[l0]);
      }
      set_event(PIPE_M, PIPE_MTE1, l0_ev);
    }

    wait_event(PIPE_MTE1, PIPE_MTE2, EVENT_ID0);
    wait_event(PIPE_MTE1, PIPE_MTE2, EVENT_ID1);
    wait_event(PIPE_M, PIPE_MTE1, EVENT_ID0);
    if (site_kept(kControlDropWaitFlag)) wait_event(PIPE_M, PIPE_MTE1, EVENT_ID1);

    // The whole padded tile goes out: the partial buffer is pad_m x pad_n, so no tail handling here.
    __gm__ T* partial = gm_at<T>(args_.scratch, args_.layout.partial_offset) + row0 * p.pad_n + col0;
    auto dst = nd_view<T>(partial, kBaseM, kBaseN, p.pad_n);
    set_event(PIPE_M, PIPE_FIX, EVENT_ID0);
    wait_event(PIPE_M, PIPE_FIX, EVENT_ID0);
    store_tile(dst, acc_);
    note_payload_store();  // queue_publish fences before the slot's flag
  }

 private:
  // bias[col0, col0 + base_n) (fp32; the host pads the vector to pad_n, so no tail: GM -> L1 copies move whole
  // 32-byte blocks) into the bias table. Issued before the first slice's extracts, so the MTE1 -> M flag of slice
  // 0 also orders the TMOV before TMATMUL_BIAS.
  AICORE inline void load_bias(int64_t col0) {
    auto src = nd_view<float>(gm_at<float>(args_.bias, 0) + col0, 1, kBaseN, kBaseN);
    TLOAD(bias_row_, src);
    set_event(PIPE_MTE2, PIPE_MTE1, EVENT_ID2);
    wait_event(PIPE_MTE2, PIPE_MTE1, EVENT_ID2);
    TMOV(bias_table_, bias_row_);
  }

  // A[src.row0:+rows, k0:+kv] and the matching B block into L1 buffer `buf`.
  AICORE inline void load_panel(int buf, const ARows& src, int64_t rows, int64_t col0, int64_t cols, int64_t k0) {
    const TilePlan& p = args_.plan;
    const int64_t kv = (p.k - k0) < kStepK ? (p.k - k0) : static_cast<int64_t>(kStepK);
    const uint32_t a_addr = buf == 0 ? kL1A0 : kL1A1;
    const uint32_t b_addr = buf == 0 ? kL1B0 : kL1B1;
    if (rows < kBaseM || cols < kBaseN || kv < kStepK) {
      // Zero the whole panels first. Fenced on both sides (edge tiles only): the fill must not overtake the
      // extracts still reading this buffer, nor the loads below overtake the fill, whatever pipe it runs on.
      pipe_barrier(PIPE_ALL);
      TEXPANDS(a_panel_[buf], static_cast<T>(0));
      TEXPANDS(b_panel_[buf], static_cast<T>(0));
      pipe_barrier(PIPE_ALL);
    }
    typename Tiles::APanelLoad a_load(static_cast<unsigned>(rows), static_cast<unsigned>(kv));
    TASSIGN(a_load, a_addr);
    auto a_src = nd_view<T>(gm_at<T>(src.a, 0) + src.row0 * src.lda + k0, rows, kv, src.lda);
    TLOAD(a_load, a_src);

    typename Tiles::BPanelLoad b_load(static_cast<unsigned>(kv), static_cast<unsigned>(cols));
    TASSIGN(b_load, b_addr);
    if constexpr (Tiles::kTransposed) {
      auto b_src = dn_view<T>(gm_at<T>(args_.b, 0) + col0 * args_.ldb + k0, kv, cols, args_.ldb);
      TLOAD(b_load, b_src);
    } else {
      auto b_src = nd_view<T>(gm_at<T>(args_.b, 0) + k0 * args_.ldb + col0, kv, cols, args_.ldb);
      TLOAD(b_load, b_src);
    }
  }

  const KernelArgs& args_;
  typename Tiles::APanel a_panel_[2];
  typename Tiles::BPanel b_panel_[2];
  typename Tiles::BiasRow bias_row_;
  typename Tiles::Left left_[2];
  typename Tiles::Right right_[2];
  typename Tiles::Acc acc_;
  typename Tiles::BiasTable bias_table_;
};

}  // namespace device
}  // namespace gemm_ar
