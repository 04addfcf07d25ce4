// Output buffers of the CPU fused engine, kept for reuse once the caller frees the tensor. A fresh large buffer
// costs as much in page faults and kernel zeroing as the whole reduction or more, because glibc maps large blocks
// anew every time. Returned tensors are ordinary CPU tensors (their storage is resizable); freed buffers wait, by
// exact size, until TORCH_GEMM_AR_OUTPUT_CACHE_MB (default 512) would be exceeded, beyond which they are released at
// once.
#pragma once
#include <ATen/ATen.h>

namespace gemm_ar::cpu {

// An uninitialised [rows, cols] tensor whose memory comes from the pool.
at::Tensor pooled_empty(int64_t rows, int64_t cols, at::ScalarType dtype);

// Frees every cached buffer (tensors still in use are unaffected): called when a group's engine is released.
void trim_output_pool();

}  // namespace gemm_ar::cpu
