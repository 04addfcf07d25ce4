// Device entry points of the two kernels. The launch shims (kernel_launch.h) call them with <<<>>> on the NPU; the
// CPU-simulator harness (tests/kernels_sim) calls them directly, one thread per block.
#pragma once
#include <pto/pto-inst.hpp>

// args: device copy of a gemm_ar::KernelArgs. Block index from get_block_idx(), block count from args.
__global__ AICORE void GemmComputeKernel(__gm__ uint8_t* args);
__global__ AICORE void GemmCommKernel(__gm__ uint8_t* args);
