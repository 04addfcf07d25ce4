// The ops' schemas, all from the op table (op_table.h; docs/decisions/0001-op-family-as-torch-library-ops.md).
// Device implementations register themselves in their own files (cpu/*_op.cpp, npu/*_op.cpp); the fake kernels live
// in torch_gemm_ar/_registrations.py, the autograd formulas in autograd.cpp, sequence_parallel_autograd.cpp and
// add_rmsnorm_op.cpp.
#include <torch/library.h>

#include "op_table.h"

TORCH_LIBRARY(pto, m) {
  for (const auto& op : gemm_ar::kOps) m.def(op.schema);
}
