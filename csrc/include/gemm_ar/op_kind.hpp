// The ops of the family, one code each, shared by the host (its call signature, field `op`) and the NPU kernels
// (KernelArgs and the sequence-parallel walks): an op is the same number everywhere.
#pragma once
#include <cstdint>

namespace gemm_ar {

enum OpKind : uint32_t {
  kOpGemmAllreduce = 0,
  kOpGemmReduceScatter = 1,
  kOpAllgatherGemm = 2,
  kOpGemmAllreduceAddRmsnorm = 3,
};

}  // namespace gemm_ar
