// The gradient of the op's `b` for backward: a^T @ g, produced in b's own memory layout. nn.Linear-style callers
// pass b = weight.t() (a transposed view); a contiguous [K, N] gradient would reach the weight as a transposed
// view, and AccumulateGrad copies a gradient whose strides differ from its parameter's (the layout contract), once
// per layer and step. Computing (g^T @ a)^T instead costs the same GEMM and hands over the weight's layout.
#pragma once
#include <ATen/ATen.h>

namespace gemm_ar {

// a2d: [M, K], g2d: [M, N]; returns [K, N] strided like `b` when b is a transposed contiguous matrix.
inline at::Tensor grad_of_b(const at::Tensor& b, const at::Tensor& a2d, const at::Tensor& g2d) {
  const bool transposed = b.dim() == 2 && !b.is_contiguous() && b.t().is_contiguous();
  return transposed ? at::matmul(g2d.t(), a2d).t() : at::matmul(a2d.t(), g2d);
}

}  // namespace gemm_ar
