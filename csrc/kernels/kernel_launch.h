// Host-callable launch shims of the two Ascend kernels (defined in gemm_compute_kernel.cpp and
// gemm_comm_kernel.cpp, compiled by bisheng; absent from CPU-simulator builds).
//
// args_device: device address of a gemm_ar::KernelArgs (csrc/include/gemm_ar/kernel_args.hpp) that stays valid
// until both kernels have finished; both launches of one call take the same copy.
// block_dim must equal args.compute_blocks / args.comm_blocks. All comm blocks must be resident at once (they wait
// on one another across ranks), so comm_blocks <= free AIV cores. The compute kernels of gemm_allreduce and
// gemm_reduce_scatter never wait; allgather_gemm's waits for rows its comm kernel delivers, so the two kernels of a
// call must run on different streams (the host gives each group its own comm stream).
// Launch both kernels for every call on every rank, the comm kernel of call e+1 only after the comm kernel of call
// e has finished (the group's order of fused calls guarantees it: npu/fused_call_sequence.h), and the compute kernel of
// call e+1 only after the comm kernel of call e has finished if they share the scratch.
#pragma once
#include <cstdint>

namespace gemm_ar {

// Cube kernel: C_local = a @ b (+ bias on args.bias_rank) tile by tile into the scratch, publishing each tile.
void launch_gemm_compute(uint32_t block_dim, void* stream, void* args_device);

// Vector kernel: reduce-scatter into the owners' windows, all-gather to every rank, result into args.out (the decode
// variant, args.variant: every partial pushed to every rank, summed there in rank order).
void launch_gemm_comm(uint32_t block_dim, void* stream, void* args_device);

}  // namespace gemm_ar
