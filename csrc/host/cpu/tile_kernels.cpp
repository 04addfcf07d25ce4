#include "cpu/tile_kernels.h"

#include "common/current_op.h"
#include "common/element_casts.h"
#include "cpu/reduce_avx512.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstring>

namespace gemm_ar::cpu {
namespace {

constexpr int64_t kChunk = 256;  // columns summed at a time in a register-friendly buffer

template <typename In, typename Acc, typename Out>
GEMM_AR_INLINE void reduce_typed(const ReduceRows& job) {
  using InCast = FastCasts<In, Acc>;
  using OutCast = FastCasts<Out, Acc>;
  Acc acc[kChunk];
  for (int64_t i = 0; i < job.rows; ++i) {
    auto* out = reinterpret_cast<Out*>(job.out) + i * job.out_stride;
    for (int64_t c0 = 0; c0 < job.cols; c0 += kChunk) {
      const int64_t n = std::min(kChunk, job.cols - c0);
      const In* first = reinterpret_cast<const In*>(job.sources[0]) + i * job.source_stride + c0;
      for (int64_t j = 0; j < n; ++j) acc[j] = InCast::load(first[j]);
      for (int r = 1; r < job.world; ++r) {
        const In* src = reinterpret_cast<const In*>(job.sources[r]) + i * job.source_stride + c0;
        for (int64_t j = 0; j < n; ++j) acc[j] += InCast::load(src[j]);
      }
      if (job.add_into_out) {
        // The bank gets the plain sum (peers add their own residual); out the sum plus this rank's residual.
        auto* bank = job.bank != nullptr ? reinterpret_cast<Out*>(job.bank) + i * job.bank_stride + c0 : nullptr;
        if (bank != nullptr) {
          for (int64_t j = 0; j < n; ++j) bank[j] = OutCast::store(acc[j]);
        }
        for (int64_t j = 0; j < n; ++j) {
          out[c0 + j] = OutCast::store(OutCast::load(OutCast::store(acc[j])) + OutCast::load(out[c0 + j]));
        }
      } else {
        for (int64_t j = 0; j < n; ++j) out[c0 + j] = OutCast::store(acc[j]);
      }
    }
    // The row is still in cache: the copy peers read costs little here.
    if (job.bank != nullptr && !job.add_into_out) {
      std::memcpy(job.bank + i * job.bank_stride * sizeof(Out), out, job.cols * sizeof(Out));
    }
  }
}

template <typename T, typename Acc>
GEMM_AR_INLINE void add_typed(const T* src, int64_t src_stride, T* dst, int64_t dst_stride, int64_t rows,
                              int64_t cols) {
  using Cast = FastCasts<T, Acc>;
  for (int64_t i = 0; i < rows; ++i) {
    const T* s = src + i * src_stride;
    T* d = dst + i * dst_stride;
    for (int64_t j = 0; j < cols; ++j) d[j] = Cast::store(Cast::load(s[j]) + Cast::load(d[j]));
  }
}

// The hot instantiations, compiled for each instruction set (element_casts.h).
GEMM_AR_VECTOR_CLONES void reduce_f32(const ReduceRows& job) { reduce_typed<float, float, float>(job); }
GEMM_AR_VECTOR_CLONES void reduce_f32_to_bf16(const ReduceRows& job) { reduce_typed<float, float, c10::BFloat16>(job); }
GEMM_AR_VECTOR_CLONES void reduce_bf16(const ReduceRows& job) {
  reduce_typed<c10::BFloat16, float, c10::BFloat16>(job);
}
GEMM_AR_VECTOR_CLONES void add_f32(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t rows,
                                   int64_t cols) {
  add_typed<float, float>(src, src_stride, dst, dst_stride, rows, cols);
}
GEMM_AR_VECTOR_CLONES void add_bf16(const c10::BFloat16* src, int64_t src_stride, c10::BFloat16* dst,
                                    int64_t dst_stride, int64_t rows, int64_t cols) {
  add_typed<c10::BFloat16, float>(src, src_stride, dst, dst_stride, rows, cols);
}

}  // namespace

void reduce_rows(const ReduceRows& job) {
  if (reduce_rows_avx512(job)) return;
  const auto in = job.partial_dtype, out = job.out_dtype;
  if (in == at::kDouble && out == at::kDouble) return reduce_typed<double, double, double>(job);
  if (in == at::kFloat && out == at::kFloat) return reduce_f32(job);
  if (in == at::kFloat && out == at::kBFloat16) return reduce_f32_to_bf16(job);
  if (in == at::kFloat && out == at::kHalf) return reduce_typed<float, float, c10::Half>(job);
  // Partials already in half precision (CPUs with native half-precision GEMMs): summed in fp32.
  if (in == at::kBFloat16 && out == at::kBFloat16) return reduce_bf16(job);
  if (in == at::kHalf && out == at::kHalf) return reduce_typed<c10::Half, float, c10::Half>(job);
  TORCH_CHECK(false, current_op(), ": no CPU reduction from ", in, " partials to ", out);
}

void add_rows_into(const uint8_t* src, int64_t src_stride, uint8_t* dst, int64_t dst_stride, int64_t rows, int64_t cols,
                   at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return add_f32(reinterpret_cast<const float*>(src), src_stride, reinterpret_cast<float*>(dst), dst_stride, rows,
                     cols);
    case at::kDouble:
      return add_typed<double, double>(reinterpret_cast<const double*>(src), src_stride, reinterpret_cast<double*>(dst),
                                       dst_stride, rows, cols);
    case at::kBFloat16:
      return add_bf16(reinterpret_cast<const c10::BFloat16*>(src), src_stride, reinterpret_cast<c10::BFloat16*>(dst),
                      dst_stride, rows, cols);
    case at::kHalf:
      return add_typed<c10::Half, float>(reinterpret_cast<const c10::Half*>(src), src_stride,
                                         reinterpret_cast<c10::Half*>(dst), dst_stride, rows, cols);
    default: TORCH_CHECK(false, "gemm_allreduce_add_rmsnorm_: no CPU residual add for ", dtype);
  }
}

void copy_rows(const uint8_t* src, int64_t src_stride_bytes, uint8_t* dst, int64_t dst_stride_bytes, int64_t rows,
               int64_t row_bytes) {
  if (src_stride_bytes == row_bytes && dst_stride_bytes == row_bytes) {
    std::memcpy(dst, src, rows * row_bytes);
    return;
  }
  for (int64_t i = 0; i < rows; ++i) std::memcpy(dst + i * dst_stride_bytes, src + i * src_stride_bytes, row_bytes);
}

}  // namespace gemm_ar::cpu
