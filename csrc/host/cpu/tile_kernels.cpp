#include "cpu/tile_kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstring>

namespace gemm_ar::cpu {
namespace {

constexpr int64_t kChunk = 256;  // columns summed at a time in a register-friendly buffer

template <typename Acc, typename Out>
void reduce_typed(const ReduceRows& job) {
  Acc acc[kChunk];
  for (int64_t i = 0; i < job.rows; ++i) {
    auto* bank = reinterpret_cast<Out*>(job.bank) + i * job.bank_stride;
    auto* out = reinterpret_cast<Out*>(job.out) + i * job.out_stride;
    for (int64_t c0 = 0; c0 < job.cols; c0 += kChunk) {
      const int64_t n = std::min(kChunk, job.cols - c0);
      const Acc* first = reinterpret_cast<const Acc*>(job.sources[0]) + i * job.source_stride + c0;
      for (int64_t j = 0; j < n; ++j) acc[j] = first[j];
      for (int r = 1; r < job.world; ++r) {
        const Acc* src = reinterpret_cast<const Acc*>(job.sources[r]) + i * job.source_stride + c0;
        for (int64_t j = 0; j < n; ++j) acc[j] += src[j];
      }
      for (int64_t j = 0; j < n; ++j) {
        const Out value = static_cast<Out>(acc[j]);
        bank[c0 + j] = value;
        out[c0 + j] = value;
      }
    }
  }
}

}  // namespace

void reduce_rows(const ReduceRows& job) {
  if (job.partial_dtype == at::kDouble) {
    TORCH_CHECK(job.out_dtype == at::kDouble, "gemm_allreduce: float64 partials need a float64 output");
    return reduce_typed<double, double>(job);
  }
  switch (job.out_dtype) {
    case at::kFloat: return reduce_typed<float, float>(job);
    case at::kBFloat16: return reduce_typed<float, c10::BFloat16>(job);
    case at::kHalf: return reduce_typed<float, c10::Half>(job);
    default: TORCH_CHECK(false, "gemm_allreduce: no CPU reduction for ", job.out_dtype);
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
