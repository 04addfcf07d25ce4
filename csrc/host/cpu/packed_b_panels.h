// B's column panels packed once per call for the BLAS's packed-matrix GEMM (oneMKL's cblas_sgemm_pack and
// cblas_sgemm_compute, looked up at run time in the BLAS that torch links). The engine multiplies B's panel of
// base_n columns once per tile row; through at::mm every such tile packs the panel again, which makes the engine's
// tiled GEMM clearly slower than one whole GEMM. Packed once and reused by every tile row, the tiles cost about what
// the whole GEMM costs (docs/journal/performance-journal.md, "The engine's tiles through packed B panels").
#pragma once
#include <ATen/ATen.h>

#include <memory>
#include <mutex>
#include <vector>

#include "common/local_gemm.h"

namespace gemm_ar::cpu {

class PackedBPanels final : public ColumnPanelGemm {
 public:
  // b: the call's fp32 [K, N] operand (row-major or a transposed row-major view); panels of `panel_cols` columns,
  // packed for products of up to `tile_rows` rows. usable() is false when the BLAS has no packed GEMM, or b's
  // dtype, strides or sizes do not suit it (under 16K elements, or packed panels over
  // TORCH_GEMM_AR_PACKED_B_MAX_MB); the caller then keeps at::mm.
  PackedBPanels(const at::Tensor& b, int64_t panel_cols, int64_t tile_rows);

  bool usable() const { return usable_; }

  // out (fp32, unit column stride) = a_rows @ b[:, col0 : col0 + cols] (+ out when `accumulate`); false (nothing
  // written) when a_rows or out do not suit the packed GEMM. Packs the panel on its first use; thread-safe.
  bool multiply(const at::Tensor& a_rows, int64_t col0, int64_t cols, at::Tensor& out, bool accumulate) const override;

 private:
  void pack(int64_t panel) const;
  uint8_t* panel_base(int64_t panel) const;

  bool usable_ = false;
  at::Tensor b_;
  int64_t k_ = 0, n_ = 0, panel_cols_ = 0, tile_rows_ = 0;
  bool transposed_ = false;       // b is a transposed row-major [N, K]
  at::Tensor storage_;            // every panel's packed form, from the output pool (no page faults per call)
  std::vector<int64_t> offsets_;  // bytes into storage_ per panel
  std::unique_ptr<std::once_flag[]> packed_;
};

// Whether torch's BLAS has the packed GEMM (oneMKL builds of torch).
bool packed_b_gemm_available();

// Panels packed by this process (tests: the engine really takes the packed path).
int64_t packed_b_panel_count();

}  // namespace gemm_ar::cpu
