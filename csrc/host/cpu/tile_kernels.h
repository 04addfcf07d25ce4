// The data movement of the CPU engine: the owner's fixed-order reduction of every rank's partial product (which
// makes the result bitwise identical on all ranks and runs), and the all-gather copy of a finished subtile.
#pragma once
#include <c10/core/ScalarType.h>

#include <cstdint>

namespace gemm_ar::cpu {

struct ReduceRows {
  const uint8_t* const* sources;  // world pointers to the first element of each rank's partial rows
  int world;
  int64_t source_stride;         // elements between rows of a partial
  at::ScalarType partial_dtype;  // the dtype of the partial products (the sum is accumulated in float or double)
  uint8_t* bank;                 // the owner's reduced rows (window; peers copy from it); nullptr: none
  int64_t bank_stride;
  uint8_t* out;  // the owner's own output rows
  int64_t out_stride;
  at::ScalarType out_dtype;
  int64_t rows, cols;
  // Set when `out` holds an addend (the residual of the in-place add+RMSNorm): out = round(round(sum) + out), the
  // bank still gets round(sum). The same roundings as the epilogue's out = round(reduced + residual).
  bool add_into_out = false;
};

// out (and bank, if any) = sum over ranks 0..world-1, in that order, rounded once to out_dtype.
void reduce_rows(const ReduceRows& job);

// dst = round(src + dst) elementwise, `rows` rows of `cols` elements of `dtype`, strides in elements: a finished
// subtile of another owner added to this rank's residual (in-place add+RMSNorm).
void add_rows_into(const uint8_t* src, int64_t src_stride, uint8_t* dst, int64_t dst_stride, int64_t rows, int64_t cols,
                   at::ScalarType dtype);

// Copies `rows` rows of `row_bytes` bytes between strided buffers.
void copy_rows(const uint8_t* src, int64_t src_stride_bytes, uint8_t* dst, int64_t dst_stride_bytes, int64_t rows,
               int64_t row_bytes);

}  // namespace gemm_ar::cpu
