// The optional epilogue of gemm_allreduce's fused NPU kernels (docs/decisions/0011-add-rmsnorm-epilogue.md): what the
// comm kernel does with a row band once all of its columns are reduced on this rank. Carried by KernelArgs::epilogue
// (kernel_args.hpp); the host fills it only for gemm_allreduce_add_rmsnorm, every other call (the sequence-parallel
// ones included) leaves it zero (kEpilogueNone), and the sequence-parallel kernels refuse arguments that carry one.
//
// kEpilogueAddRmsNorm: out = reduced + residual (rounded to the call dtype: the new residual stream);
// normed = out * rsqrt(mean(out^2, -1) + eps) * norm_weight, row statistics in fp32. Every rank normalises its own
// copy of every row from the same reduced values with the same instructions, so both outputs are bitwise
// identical across ranks (docs/ascend.md, "The add+RMSNorm epilogue").
#pragma once
#include <cstdint>

#include "fn.hpp"

namespace gemm_ar {

enum EpilogueKind : uint32_t {
  kEpilogueNone = 0,
  kEpilogueAddRmsNorm = 1,
};

struct EpilogueArgs {
  uint32_t kind;         // EpilogueKind
  float eps;             // >= 0, finite; the same on every rank (its bits are in the call signature)
  uint64_t residual;     // [M, N] call dtype, residual[m * ld_residual + n]; replicated: the same on every rank
  uint64_t norm_weight;  // [N] call dtype, contiguous
  uint64_t normed;       // [M, N] call dtype, normed[m * ld_normed + n]: written by the comm kernel
  int64_t ld_residual, ld_normed;  // row strides in elements (DMA strides: 16-bit on A2/A3, like lda/ldo)
};

static_assert(sizeof(EpilogueArgs) % sizeof(int64_t) == 0, "KernelArgs is copied as 64-bit words");

// Whether an epilogue's operands make sense for an [m, n] output; kEpilogueNone always does.
GEMM_AR_FN bool epilogue_args_usable(const EpilogueArgs& e, int64_t n) {
  if (e.kind == kEpilogueNone) return true;
  if (e.kind != kEpilogueAddRmsNorm) return false;
  if (e.residual == 0 || e.norm_weight == 0 || e.normed == 0) return false;
  if (e.ld_residual < n || e.ld_normed < n || e.ld_residual > 65535 || e.ld_normed > 65535) return false;
  return e.eps >= 0.0f && e.eps <= 3.40282347e38f;  // FLT_MAX, as the host checks; false for NaN and infinity
}

}  // namespace gemm_ar
