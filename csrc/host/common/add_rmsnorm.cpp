#include "common/add_rmsnorm.h"

#include "common/element_casts.h"

#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cmath>
#include <limits>
#include <cstring>
#include <type_traits>
#include <sstream>

namespace gemm_ar {
namespace {

std::string shape_str(at::IntArrayRef sizes) {
  std::ostringstream os;
  os << sizes;
  return os.str();
}

// normed[j] = out[j] * rstd * weight[j] for j in [begin, end), ordinary stores.
template <class T, class Acc, class Cast>
inline __attribute__((always_inline)) void scale_row(const T* __restrict__ out, const T* __restrict__ weight,
                                                     T* __restrict__ normed, int64_t begin, int64_t end, Acc rstd) {
  for (int64_t j = begin; j < end; ++j) normed[j] = Cast::store(Cast::load(out[j]) * rstd * Cast::load(weight[j]));
}

// One row: 8 independent partial sums so the compiler can vectorise the square sum; their order is fixed.
// kAdd=false: `out` already holds reduced + residual (the in-place variant added it during the reduction), so the
// row is only normalised; `residual` is not read.
template <class T, class Acc, class Cast = Casts<T, Acc>, bool kAdd = true>
inline __attribute__((always_inline)) void add_rmsnorm_row(T* __restrict__ out, const T* __restrict__ residual,
                                                           const T* __restrict__ weight, T* __restrict__ normed,
                                                           int64_t n, Acc eps) {
  constexpr int kLanes = 8;
  Acc lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      T rounded = out[i + l];
      if constexpr (kAdd) {
        rounded = Cast::store(Cast::load(out[i + l]) + Cast::load(residual[i + l]));
        out[i + l] = rounded;
      }
      const Acc x = Cast::load(rounded);
      lanes[l] += x * x;
    }
  }
  for (; i < n; ++i) {
    T rounded = out[i];
    if constexpr (kAdd) {
      rounded = Cast::store(Cast::load(out[i]) + Cast::load(residual[i]));
      out[i] = rounded;
    }
    const Acc x = Cast::load(rounded);
    lanes[0] += x * x;
  }
  Acc sum = 0;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  const Acc rstd = Acc(1) / std::sqrt(sum / static_cast<Acc>(n) + eps);
  scale_row<T, Acc, Cast>(out, weight, normed, 0, n, rstd);
}

// residual == nullptr: normalise only (kAdd=false), in every row function below.
GEMM_AR_VECTOR_CLONES void add_rmsnorm_row_f32(float* out, const float* residual, const float* weight, float* normed,
                                               int64_t n, float eps) {
  if (residual == nullptr)
    return add_rmsnorm_row<float, float, Casts<float, float>, false>(out, residual, weight, normed, n, eps);
  add_rmsnorm_row<float, float>(out, residual, weight, normed, n, eps);
}

#if defined(__GNUC__) && defined(__x86_64__)
#define GEMM_AR_HAVE_AVX2_BF16_ROW 1
// The bf16 row with AVX2 intrinsics, 8 floats per step: GCC does not vectorise the bf16 <-> fp32 conversions of
// the generic loop, which then runs scalar (docs/journal/performance-journal.md). The same operations in
// the same order as add_rmsnorm_row<bf16> -- 8 square-sum lanes, lane l taking elements l, l+8, ..., the tail in
// lane 0, the lanes summed 0..7, RNE rounding with NaN -> 0x7FC0 -- so every rank's result is bitwise the same
// whichever of the two runs.
namespace avx2_bf16 {

__attribute__((target("avx2"))) inline __m256 widen(const uint16_t* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

__attribute__((target("avx2"))) inline __m128i narrow(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
  const __m256i chosen = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  // 32 -> 16 bits (values fit): packus works per 128-bit half, so gather the two halves' low quadwords.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(chosen, chosen), 0x08);
  return _mm256_castsi256_si128(packed);
}

template <bool kAdd>
__attribute__((target("avx2"))) void row(uint16_t* out, const uint16_t* residual, const uint16_t* weight,
                                         uint16_t* normed, int64_t n, float eps) {
  __m256 lanes = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i rounded = _mm_loadu_si128(reinterpret_cast<const __m128i*>(out + i));
    if constexpr (kAdd) {
      rounded = narrow(_mm256_add_ps(widen(out + i), widen(residual + i)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), rounded);
    }
    const __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(rounded), 16));
    lanes = _mm256_add_ps(lanes, _mm256_mul_ps(x, x));
  }
  alignas(32) float lane[8];
  _mm256_store_ps(lane, lanes);
  using Cast = BFloat16Bits;
  auto* out16 = reinterpret_cast<at::BFloat16*>(out);
  const auto* residual16 = reinterpret_cast<const at::BFloat16*>(residual);
  for (; i < n; ++i) {
    at::BFloat16 rounded = out16[i];
    if constexpr (kAdd) {
      rounded = Cast::store(Cast::load(out16[i]) + Cast::load(residual16[i]));
      out16[i] = rounded;
    }
    const float x = Cast::load(rounded);
    lane[0] += x * x;
  }
  float sum = 0;
  for (int l = 0; l < 8; ++l) sum += lane[l];
  const float rstd = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  const __m256 scale = _mm256_set1_ps(rstd);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m128i v = narrow(_mm256_mul_ps(_mm256_mul_ps(widen(out + j), scale), widen(weight + j)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(normed + j), v);
  }
  scale_row<at::BFloat16, float, Cast>(out16, reinterpret_cast<const at::BFloat16*>(weight),
                                       reinterpret_cast<at::BFloat16*>(normed), j, n, rstd);
}

}  // namespace avx2_bf16
#endif

void add_rmsnorm_row_bf16(at::BFloat16* out, const at::BFloat16* residual, const at::BFloat16* weight,
                          at::BFloat16* normed, int64_t n, float eps) {
#ifdef GEMM_AR_HAVE_AVX2_BF16_ROW
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) {
    auto* row = residual != nullptr ? &avx2_bf16::row<true> : &avx2_bf16::row<false>;
    return row(reinterpret_cast<uint16_t*>(out), reinterpret_cast<const uint16_t*>(residual),
               reinterpret_cast<const uint16_t*>(weight), reinterpret_cast<uint16_t*>(normed), n, eps);
  }
#endif
  if (residual == nullptr) {
    return add_rmsnorm_row<at::BFloat16, float, BFloat16Bits, false>(out, residual, weight, normed, n, eps);
  }
  add_rmsnorm_row<at::BFloat16, float, BFloat16Bits>(out, residual, weight, normed, n, eps);
}

template <class T, class Acc>
void add_rmsnorm_row_any(T* out, const T* residual, const T* weight, T* normed, int64_t n, Acc eps) {
  if constexpr (std::is_same_v<T, float>) {
    add_rmsnorm_row_f32(out, residual, weight, normed, n, eps);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    add_rmsnorm_row_bf16(out, residual, weight, normed, n, eps);
  } else if (residual == nullptr) {
    add_rmsnorm_row<T, Acc, Casts<T, Acc>, false>(out, residual, weight, normed, n, eps);
  } else {
    add_rmsnorm_row<T, Acc>(out, residual, weight, normed, n, eps);
  }
}

}  // namespace

void check_add_rmsnorm_args(CallArgs& call, const at::Tensor& residual, const at::Tensor& norm_weight, double eps) {
  // Ranks mixing this op with plain gemm_allreduce on one call would disagree on more than the epilogue.
  call.op = kOpGemmAllreduceAddRmsnorm;
  call.op_name = "gemm_allreduce_add_rmsnorm";
  // Ranks must share eps (both outputs are bitwise the same on every rank): its bits ride in the op's parameter.
  std::memcpy(&call.shard_dim, &eps, sizeof eps);
  auto fail = [&](int64_t code, const std::string& message) {
    call.error_code = code;
    call.error = call.op_name + ": " + message;
  };
  const at::Tensor& a = call.a2d;
  // Both have the result's dtype (a's, unless a quantized call's out_dtype says otherwise).
  const std::string dtype = c10::toString(call.out_dtype);
  const std::string of = call.out_dtype == call.dtype ? "a" : "the result (out_dtype)";
  if (!residual.defined()) return fail(kBadResidualError, "residual is undefined");
  if (residual.sizes() != at::IntArrayRef(call.out_shape)) {
    return fail(kBadResidualError, "residual must have shape a.shape[:-1] + [N] = " + shape_str(call.out_shape) +
                                       "; got " + shape_str(residual.sizes()));
  }
  if (residual.scalar_type() != call.out_dtype) {
    return fail(kBadResidualError, "residual must have the dtype of " + of + " (" + dtype + "); got " +
                                       std::string(c10::toString(residual.scalar_type())));
  }
  if (residual.device() != a.device()) {
    return fail(kBadResidualError,
                "residual must be on the device of a (" + a.device().str() + "); got " + residual.device().str());
  }
  if (!norm_weight.defined()) return fail(kBadNormWeightError, "norm_weight is undefined");
  if (norm_weight.dim() != 1 || norm_weight.size(0) != call.n) {
    return fail(kBadNormWeightError, "norm_weight must be 1-D [N] with N=" + std::to_string(call.n) + "; got shape " +
                                         shape_str(norm_weight.sizes()));
  }
  if (norm_weight.scalar_type() != call.out_dtype) {
    return fail(kBadNormWeightError, "norm_weight must have the dtype of " + of + " (" + dtype + "); got " +
                                         std::string(c10::toString(norm_weight.scalar_type())));
  }
  if (norm_weight.device() != a.device()) {
    return fail(kBadNormWeightError,
                "norm_weight must be on the device of a (" + a.device().str() + "); got " + norm_weight.device().str());
  }
  // The statistics are fp32 (and the NPU kernels take eps as a float): eps must be a finite float too.
  if (!(eps >= 0) || !(eps <= static_cast<double>(std::numeric_limits<float>::max()))) {
    return fail(kBadNormWeightError, "eps must be >= 0 and finite as a float32; got " + std::to_string(eps));
  }
}

void add_rmsnorm_rows(at::Tensor& out2d, const at::Tensor& residual2d, const at::Tensor& weight, double eps,
                      at::Tensor& normed2d, int64_t row0, int64_t rows, bool parallel) {
  const int64_t n = out2d.size(1);
  if (rows == 0 || n == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out2d.scalar_type(), "add_rmsnorm_rows", [&] {
    using Acc = at::opmath_type<scalar_t>;
    scalar_t* out = out2d.data_ptr<scalar_t>();
    const scalar_t* residual = residual2d.defined() ? residual2d.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    scalar_t* normed = normed2d.data_ptr<scalar_t>();
    auto run = [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        add_rmsnorm_row_any<scalar_t, Acc>(out + r * n, residual != nullptr ? residual + r * n : nullptr, w,
                                           normed + r * n, n, static_cast<Acc>(eps));
      }
    };
    if (parallel) {
      at::parallel_for(row0, row0 + rows, std::max<int64_t>(1, 32768 / n), run);  // ~32k elements per task
    } else {
      run(row0, row0 + rows);
    }
  });
}

void check_in_place_residual(CallArgs& call, const at::Tensor& residual, const at::Tensor& a, const at::Tensor& b,
                             const at::Tensor& norm_weight, const std::optional<at::Tensor>& bias) {
  if (!call.error.empty()) return;
  auto fail = [&](const std::string& message) {
    call.error_code = kBadResidualError;
    call.error = call.op_name + ": " + message;
  };
  // Written while the call reads its inputs: no element of it may be an element of theirs, or of itself twice.
  if (at::has_internal_overlap(residual) == at::MemOverlap::Yes) {
    return fail(
        "residual is written in place, so its elements must not overlap (e.g. an expanded tensor); got "
        "strides " +
        shape_str(residual.strides()));
  }
  const std::pair<const char*, const at::Tensor*> inputs[] = {
      {"a", &a}, {"b", &b}, {"norm_weight", &norm_weight}, {"bias", bias ? &*bias : nullptr}};
  for (const auto& [name, t] : inputs) {
    // Different storages never overlap; within one storage, "too hard to tell" counts as sharing.
    if (t != nullptr && t->defined() && t->numel() > 0 && residual.numel() > 0 && t->has_storage() &&
        residual.storage().is_alias_of(t->storage()) &&
        at::get_overlap_status(residual, *t) != at::MemOverlapStatus::No) {
      return fail(std::string("residual is written in place and must not share memory with ") + name);
    }
  }
}

namespace {

// The unfused epilogue of a backend, on the reduction's output (in place) once gemm_allreduce returned.
using UnfusedAddRmsNorm = std::function<void(at::Tensor& out2d, const AddRmsNormOperands& ops)>;

// The op's flow for every backend: gemm_allreduce with the epilogue inside the fused path when `fused` is given and
// the call runs fused, else `unfused` after it. `in_place`: the new residual stream goes into `residual` (returned
// as out), and `fused` adds into ops.residual2d itself.
std::tuple<at::Tensor, at::Tensor> run_with_epilogue(
    const at::Tensor& a, const at::Tensor& b, const at::Tensor& residual, const at::Tensor& norm_weight,
    std::string_view group_name, double eps, const std::optional<at::Tensor>& bias, std::string_view algorithm,
    const BackendHooks& backend, const FusedAddRmsNorm& fused, const UnfusedAddRmsNorm& unfused,
    const OutputAllocator& allocate_normed, bool in_place, const QuantInputs& quant) {
  AddRmsNormOperands ops;
  ops.eps = eps;
  ops.in_place = in_place;
  auto prepare = [&](const CallArgs& call) {
    // In place: a view of residual itself when it is contiguous (the fused path adds into it), else a copy that
    // is copied back below.
    ops.residual2d = residual.reshape({call.m, call.n}).contiguous();
    ops.weight = norm_weight.contiguous();
    ops.normed2d = allocate_normed
                       ? allocate_normed(call.m, call.n, residual.scalar_type())
                       : at::empty({call.m, call.n}, residual.options().memory_format(at::MemoryFormat::Contiguous));
  };
  auto written_back = [&](const at::Tensor& new_residual) {
    if (!residual.is_contiguous() || new_residual.data_ptr() != residual.data_ptr()) {
      residual.copy_(new_residual.view(residual.sizes()));
    }
    return residual;
  };
  bool applied = false;
  BackendHooks hooks = backend;
  if (fused) {
    hooks.run_fused = [&](const CallArgs& call, c10d::ProcessGroup& group) {
      prepare(call);
      at::Tensor out = fused(call, group, ops);
      applied = true;
      return out;
    };
  }
  at::Tensor out = run_gemm_allreduce(
      a, b, group_name, bias, algorithm, hooks,
      [&](CallArgs& call) {
        check_add_rmsnorm_args(call, residual, norm_weight, eps);
        if (in_place) check_in_place_residual(call, residual, a, b, norm_weight, bias);
      },
      in_place ? "gemm_allreduce_add_rmsnorm_" : "gemm_allreduce_add_rmsnorm", quant);
  if (applied) return {in_place ? written_back(out) : out, ops.normed2d.view(out.sizes())};
  // Unfused: one pass over the reduction's output, which is this call's own tensor (fresh, or taken from the
  // engine's pool for this call), so the new residual stream is written into it in place.
  if (!out.is_contiguous()) out = out.contiguous();
  const int64_t n = out.size(-1);
  const int64_t m = n > 0 ? out.numel() / n : 0;
  CallArgs shape;
  shape.m = m;
  shape.n = n;
  prepare(shape);
  ops.in_place = false;  // the residual is added here, into the reduction's own output
  at::Tensor out2d = out.view({m, n});
  unfused(out2d, ops);
  return {in_place ? written_back(out) : out, ops.normed2d.view(out.sizes())};
}

// The CPU row loop as a backend's epilogue: inside its fused path per row block, or in one pass afterwards.
std::tuple<at::Tensor, at::Tensor> run_with_row_epilogue(
    const at::Tensor& a, const at::Tensor& b, const at::Tensor& residual, const at::Tensor& norm_weight,
    std::string_view group_name, double eps, const std::optional<at::Tensor>& bias, std::string_view algorithm,
    const BackendHooks& backend, const FusedWithEpilogue& fused_with_epilogue, const OutputAllocator& allocate_normed,
    bool in_place, const QuantInputs& quant) {
  FusedAddRmsNorm fused;
  if (fused_with_epilogue) {
    // The fused path calls back per row block, on the host, once those rows are final.
    fused = [&](const CallArgs& call, c10d::ProcessGroup& group, const AddRmsNormOperands& ops) {
      const auto options = ops.residual2d.options();
      // In place the fused path has added the residual already (into ops.residual2d): normalise only.
      const at::Tensor residual2d = ops.in_place ? at::Tensor() : ops.residual2d;
      const RowEpilogue epilogue = [&](void* out, int64_t row0, int64_t rows) {
        at::Tensor out2d = at::from_blob(out, {call.m, call.n}, options);
        at::Tensor normed2d = ops.normed2d;
        add_rmsnorm_rows(out2d, residual2d, ops.weight, ops.eps, normed2d, row0, rows, /*parallel=*/false);
      };
      return fused_with_epilogue(call, group, epilogue, ops.in_place ? ops.residual2d : at::Tensor());
    };
  }
  const UnfusedAddRmsNorm unfused = [](at::Tensor& out2d, const AddRmsNormOperands& ops) {
    at::Tensor normed2d = ops.normed2d;
    add_rmsnorm_rows(out2d, ops.residual2d, ops.weight, ops.eps, normed2d, 0, out2d.size(0), /*parallel=*/true);
  };
  return run_with_epilogue(a, b, residual, norm_weight, group_name, eps, bias, algorithm, backend, fused, unfused,
                           allocate_normed, in_place, quant);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> run_gemm_allreduce_add_rmsnorm(
    const at::Tensor& a, const at::Tensor& b, const at::Tensor& residual, const at::Tensor& norm_weight,
    std::string_view group_name, double eps, const std::optional<at::Tensor>& bias, std::string_view algorithm,
    const BackendHooks& backend, const FusedWithEpilogue& fused_with_epilogue, const OutputAllocator& allocate_normed,
    const QuantInputs& quant) {
  return run_with_row_epilogue(a, b, residual, norm_weight, group_name, eps, bias, algorithm, backend,
                               fused_with_epilogue, allocate_normed, /*in_place=*/false, quant);
}

at::Tensor run_gemm_allreduce_add_rmsnorm_inplace(const at::Tensor& a, const at::Tensor& b, const at::Tensor& residual,
                                                  const at::Tensor& norm_weight, std::string_view group_name,
                                                  double eps, const std::optional<at::Tensor>& bias,
                                                  std::string_view algorithm, const BackendHooks& backend,
                                                  const FusedWithEpilogue& fused_with_epilogue,
                                                  const OutputAllocator& allocate_normed, const QuantInputs& quant) {
  return std::get<1>(run_with_row_epilogue(a, b, residual, norm_weight, group_name, eps, bias, algorithm, backend,
                                           fused_with_epilogue, allocate_normed, /*in_place=*/true, quant));
}

std::tuple<at::Tensor, at::Tensor> run_gemm_allreduce_add_rmsnorm_on_device(
    const at::Tensor& a, const at::Tensor& b, const at::Tensor& residual, const at::Tensor& norm_weight,
    std::string_view group_name, double eps, const std::optional<at::Tensor>& bias, std::string_view algorithm,
    const BackendHooks& backend, const FusedAddRmsNorm& fused_add_rmsnorm, const QuantInputs& quant) {
  return run_with_epilogue(a, b, residual, norm_weight, group_name, eps, bias, algorithm, backend, fused_add_rmsnorm,
                           &add_rmsnorm_tensor_ops, {}, /*in_place=*/false, quant);
}

void add_rmsnorm_tensor_ops(at::Tensor& out2d, const AddRmsNormOperands& ops) {
  if (out2d.numel() == 0) return;
  const auto acc = at::toOpMathType(out2d.scalar_type());  // fp32 for fp16/bf16, as the row loop and the kernel
  // out = round(reduced + residual): the sum in fp32, one rounding to the call dtype. Device to device, in stream
  // order: non_blocking only says so.
  const at::Tensor sum = out2d.to(acc).add_(ops.residual2d.to(acc));
  out2d.copy_(sum, /*non_blocking=*/true);
  // The statistics see the rounded values, as every other path does.
  const at::Tensor x = out2d.to(acc);
  const at::Tensor rstd = at::rsqrt(x.square().mean(-1, /*keepdim=*/true).add_(ops.eps));
  at::Tensor normed2d = ops.normed2d;
  normed2d.copy_(x.mul(rstd).mul_(ops.weight.to(acc)), /*non_blocking=*/true);
}

}  // namespace gemm_ar
