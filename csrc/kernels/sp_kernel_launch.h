// Host-callable launch shims of the sequence-parallel kernel pairs (defined in sp_compute_kernel.cpp and
// sp_comm_kernel.cpp, compiled by bisheng; absent from CPU-simulator builds). Same contract as kernel_launch.h:
// args_device holds a KernelArgs planned by plan_sp_kernel_args (gemm_ar/sequence_parallel.hpp) for the op the
// shim names; both kernels of a call take the same copy; all comm blocks must be resident at once. Unlike
// gemm_allreduce's, the allgather compute kernel waits (bounded) for its comm kernel's rows.
#pragma once
#include <cstdint>

namespace gemm_ar {

void launch_rs_compute(uint32_t block_dim, void* stream, void* args_device);
void launch_rs_comm(uint32_t block_dim, void* stream, void* args_device);
void launch_ag_compute(uint32_t block_dim, void* stream, void* args_device);
void launch_ag_comm(uint32_t block_dim, void* stream, void* args_device);

}  // namespace gemm_ar
