// The ops' schemas (docs/decisions/0001-op-family-as-torch-library-ops.md). Device implementations register themselves
// in their own files (cpu/cpu_op.cpp, cpu/cpu_sequence_parallel_op.cpp, npu/npu_op.cpp); the fake kernels live in
// torch_gemm_ar/_registrations.py, the autograd formulas in autograd.cpp and sequence_parallel_autograd.cpp.
#include <torch/library.h>

TORCH_LIBRARY(pto, m) {
  m.def(
      "gemm_allreduce(Tensor a, Tensor b, str group_name, *, Tensor? bias=None, str algorithm=\"auto\") -> Tensor");
  // Sequence parallelism (symm_mem's fused_matmul_reduce_scatter / fused_all_gather_matmul conventions). The
  // gathered input is an optional second output, as symm_mem's `return_A`: None unless return_gathered.
  m.def(
      "gemm_reduce_scatter(Tensor a, Tensor b, str group_name, *, int scatter_dim=0, Tensor? bias=None, "
      "str algorithm=\"auto\") -> Tensor");
  m.def(
      "allgather_gemm(Tensor a, Tensor b, str group_name, *, int gather_dim=0, Tensor? bias=None, "
      "bool return_gathered=False, str algorithm=\"auto\") -> (Tensor, Tensor?)");
}
