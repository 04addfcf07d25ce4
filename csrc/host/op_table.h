// The op family, one row per op: its name, its schema and its OpKind (the code its calls carry in the call
// signature). ops.cpp registers every schema from this table; _C._op_table() shows it,
// and tests/test_op_table.py checks that every op has its fake kernel, its Python wrapper and its CPU kernel.
// Where each op's pieces live: docs/architecture.md §5 (the per-op path table).
#pragma once
#include <gemm_ar/op_kind.hpp>

#include <cstdint>

namespace gemm_ar {

struct OpDescription {
  const char* name;
  const char* schema;
  OpKind kind;
};

// Sequence parallelism follows symm_mem's fused_matmul_reduce_scatter / fused_all_gather_matmul conventions: the
// gathered input is an optional second output, as symm_mem's `return_A` (None unless return_gathered).
// a_scale, b_scale and out_dtype make a call quantized (W8A8, W8A16; common/quantization.h).
// gemm_allreduce_add_rmsnorm_ writes the new residual stream into `residual` and returns normed (no backward).
inline constexpr OpDescription kOps[] = {
    {"gemm_allreduce",
     "gemm_allreduce(Tensor a, Tensor b, str group_name, *, Tensor? bias=None, str algorithm=\"auto\", "
     "Tensor? a_scale=None, Tensor? b_scale=None, ScalarType? out_dtype=None) -> Tensor",
     kOpGemmAllreduce},
    {"gemm_reduce_scatter",
     "gemm_reduce_scatter(Tensor a, Tensor b, str group_name, *, int scatter_dim=0, Tensor? bias=None, "
     "str algorithm=\"auto\") -> Tensor",
     kOpGemmReduceScatter},
    {"allgather_gemm",
     "allgather_gemm(Tensor a, Tensor b, str group_name, *, int gather_dim=0, Tensor? bias=None, "
     "bool return_gathered=False, str algorithm=\"auto\") -> (Tensor, Tensor?)",
     kOpAllgatherGemm},
    {"gemm_allreduce_add_rmsnorm",
     "gemm_allreduce_add_rmsnorm(Tensor a, Tensor b, Tensor residual, Tensor norm_weight, str group_name, *, "
     "float eps=1e-6, Tensor? bias=None, str algorithm=\"auto\", Tensor? a_scale=None, Tensor? b_scale=None, "
     "ScalarType? out_dtype=None) -> (Tensor, Tensor)",
     kOpGemmAllreduceAddRmsnorm},
    {"gemm_allreduce_add_rmsnorm_",
     "gemm_allreduce_add_rmsnorm_(Tensor a, Tensor b, Tensor(a!) residual, Tensor norm_weight, str group_name, *, "
     "float eps=1e-6, Tensor? bias=None, str algorithm=\"auto\", Tensor? a_scale=None, Tensor? b_scale=None, "
     "ScalarType? out_dtype=None) -> Tensor",
     kOpGemmAllreduceAddRmsnorm},
};

}  // namespace gemm_ar
