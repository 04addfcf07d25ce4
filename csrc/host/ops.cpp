// The op's schema (design.md §3). Device implementations register themselves in their own files
// (cpu/cpu_op.cpp, npu/npu_op.cpp); the fake kernel and the autograd formula live in torch_gemm_ar/_registrations.py.
#include <torch/library.h>

TORCH_LIBRARY(pto, m) {
  m.def(
      "gemm_allreduce(Tensor a, Tensor b, str group_name, *, Tensor? bias=None, str algorithm=\"auto\") -> Tensor");
}
