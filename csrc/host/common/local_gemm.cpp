#include "common/local_gemm.h"

#include <ATen/cpu/Utils.h>

namespace gemm_ar {
namespace {

// Whether this CPU has half-precision matrix instructions that oneDNN uses: with them a half-precision GEMM is
// faster than fp32, without them far slower.
bool cpu_has_fast(at::ScalarType dtype) {
  static const auto caps = at::cpu::get_cpu_capabilities();
  auto has = [&](const char* name) {
    auto it = caps.find(name);
    return it != caps.end() && it->second.isBool() && it->second.toBool();
  };
  static const bool bf16 = has("avx512_bf16") || has("amx_bf16");
  static const bool fp16 = has("avx512_fp16") || has("amx_fp16");
  return dtype == at::kBFloat16 ? bf16 : fp16;
}

}  // namespace

bool computes_in_fp32(const at::Tensor& t) {
  const auto dtype = t.scalar_type();
  return t.is_cpu() && (dtype == at::kBFloat16 || dtype == at::kHalf) && !cpu_has_fast(dtype);
}

bool reorders_b_per_product(at::ScalarType dtype) {
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && cpu_has_fast(dtype);
}

LocalGemm::LocalGemm(const at::Tensor& a2d, const at::Tensor& b, const std::optional<at::Tensor>& bias, bool add_bias,
                     bool native) {
  const bool widen = !native && computes_in_fp32(a2d);
  // .to() keeps b's strides, so a transposed weight view stays a transposed view for BLAS.
  a_ = widen ? a2d.to(at::kFloat) : a2d;
  if (widen) source_a_ = a2d;
  b_ = widen ? b.to(at::kFloat) : b;
  if (add_bias && bias.has_value()) bias_ = widen ? bias->to(at::kFloat) : *bias;
}

void LocalGemm::refresh_rows(int64_t row0, int64_t rows) const {
  if (source_a_.defined() && rows > 0) a_.narrow(0, row0, rows).copy_(source_a_.narrow(0, row0, rows));
}

bool LocalGemm::try_panels(const at::Tensor& a_rows, int64_t col0, int64_t cols, at::Tensor& target) const {
  if (!bias_) return panels_->multiply(a_rows, col0, cols, target, /*accumulate=*/false);
  // out = bias + a @ b: the bias rows first, then the product accumulated onto them (addmm's beta = 1).
  at::Tensor bias_rows = bias_->narrow(0, col0, cols).expand({a_rows.size(0), cols});
  target.copy_(bias_rows);
  // Declined: at::addmm_out then overwrites the bias rows.
  return panels_->multiply(a_rows, col0, cols, target, /*accumulate=*/true);
}

void LocalGemm::compute(int64_t row0, int64_t rows, int64_t col0, int64_t cols, at::Tensor out) const {
  if (rows == 0 || cols == 0) return;
  auto a_rows = a_.narrow(0, row0, rows);
  auto b_cols = cols == b_.size(1) ? b_ : b_.narrow(1, col0, cols);
  const bool direct = out.scalar_type() == a_.scalar_type();
  at::Tensor target = direct ? out : at::empty({rows, cols}, out.options().dtype(a_.scalar_type()));
  if (a_.size(1) == 0) {
    target.zero_();
    if (bias_) target.add_(bias_->narrow(0, col0, cols));
  } else if (panels_ != nullptr && try_panels(a_rows, col0, cols, target)) {
    // done
  } else if (bias_) {
    at::addmm_out(target, bias_->narrow(0, col0, cols), a_rows, b_cols);
  } else {
    at::mm_out(target, a_rows, b_cols);
  }
  if (!direct) out.copy_(target);
}

}  // namespace gemm_ar
