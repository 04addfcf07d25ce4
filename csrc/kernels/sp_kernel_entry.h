// Device entry points of the sequence-parallel kernel pairs (gemm_ar/sequence_parallel.hpp): a cube kernel and a
// vector kernel per op, launched like gemm_allreduce's pair (kernel_entry.h), with the same KernelArgs planned by
// plan_sp_kernel_args. Used by the launch shims (sp_kernel_launch.h) and the simulator harness.
#pragma once
#include <pto/pto-inst.hpp>

// gemm_reduce_scatter (dim 0): every rank's partial product of every row chunk, reduced by the chunk's owner.
__global__ AICORE void GemmRsComputeKernel(__gm__ uint8_t* args);
__global__ AICORE void GemmRsCommKernel(__gm__ uint8_t* args);
// allgather_gemm (dim 0): the peers' shards of a pulled from their windows, each rank's full product.
__global__ AICORE void AgGemmComputeKernel(__gm__ uint8_t* args);
__global__ AICORE void AgGemmCommKernel(__gm__ uint8_t* args);
