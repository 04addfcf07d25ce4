// The local product a @ b (+ bias) for whole outputs, row chunks or tiles, accumulated in fp32.
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace gemm_ar {

// CPU bf16/fp16 GEMMs in ATen run far slower than fp32 without half-precision matrix instructions, so on CPUs
// without them (avx512_bf16/amx_bf16, avx512_fp16/amx_fp16) those are computed in fp32 (inputs converted once per
// call) and rounded once when stored; where the instructions exist, natively (oneDNN accumulates in fp32).
bool computes_in_fp32(const at::Tensor& t);

// Whether a CPU product of this dtype reorders all of its B operand on every call: bf16/fp16 computed natively
// (oneDNN packs B into its blocked layout per call). Tiles of such products should share B's columns, not its rows:
// every row tile reorders all of B again, a column panel of all rows only its own columns
// (docs/journal/performance-journal.md).
bool reorders_b_per_product(at::ScalarType dtype);

// A faster way to multiply by one of b's column panels (the CPU engine's packed B): out (the compute dtype, unit
// column stride) = a_rows @ b[:, col0 : col0 + cols], plus out when `accumulate`. Returns false to decline, having
// written nothing.
class ColumnPanelGemm {
 public:
  virtual ~ColumnPanelGemm() = default;
  virtual bool multiply(const at::Tensor& a_rows, int64_t col0, int64_t cols, at::Tensor& out,
                        bool accumulate) const = 0;
};

class LocalGemm {
 public:
  // `add_bias`: whether this rank contributes the bias (exactly one rank does, so it is added once).
  // `native`: compute in the call's dtype even where computes_in_fp32 holds, as torch's `a @ b` does (the CPU
  // engine's decode calls, whose GEMM is a pass over B: widening all of B to fp32 would cost more than it).
  LocalGemm(const at::Tensor& a2d, const at::Tensor& b, const std::optional<at::Tensor>& bias, bool add_bias,
            bool native = false);

  // out = a[row0 : row0+rows] @ b[:, col0 : col0+cols] (+ bias[col0 : col0+cols]).
  // `out` is a [rows, cols] view with unit column stride, of the compute dtype or the call dtype.
  // Thread-safe for disjoint outputs.
  void compute(int64_t row0, int64_t rows, int64_t col0, int64_t cols, at::Tensor out) const;

  at::ScalarType compute_dtype() const { return a_.scalar_type(); }

  // b as the GEMM sees it (the fp32 copy where the call's dtype is computed in fp32).
  const at::Tensor& b() const { return b_; }

  // Tiles go through `panels` first (it must outlive the calls of compute); nullptr: at::mm only.
  void use_panels(const ColumnPanelGemm* panels) { panels_ = panels; }

  // Rows [row0, row0 + rows) of a2d were written after construction (allgather_gemm's gathered a fills while the
  // GEMM runs): converts them again where a2d was converted. Thread-safe for disjoint rows.
  void refresh_rows(int64_t row0, int64_t rows) const;

 private:
  at::Tensor source_a_;  // a2d, kept only when a_ is its fp32 copy
  at::Tensor a_, b_;
  std::optional<at::Tensor> bias_;
  bool try_panels(const at::Tensor& a_rows, int64_t col0, int64_t cols, at::Tensor& target) const;
  const ColumnPanelGemm* panels_ = nullptr;
};

}  // namespace gemm_ar
