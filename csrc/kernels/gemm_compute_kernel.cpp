// GemmComputeKernel (cube cores): this rank's product a @ b (+ bias on one rank), tile by tile, into the scratch's
// padded partial buffer, each finished tile published in the block's ready queue (docs/architecture.md §3.2 step 2).
//
// Block b owns the balanced contiguous range block_range(tiles, P, b) of linear tile indices and walks it in
// zig-zag order so consecutive tiles share B columns; each tile is one TileComputer::run (tile_computer.hpp).
// Compute never waits for comm.
#include <pto/pto-inst.hpp>

#include "device_support.hpp"
#include "kernel_entry.h"
#include "ready_queue.hpp"
#include "tile_computer.hpp"

namespace gemm_ar {
namespace device {
namespace {

template <uint32_t DType, uint32_t BLayoutCode>
AICORE inline void compute_all_tiles(const KernelArgs& args, int64_t block) {
  using T = typename ElemOf<DType>::type;
  TileComputer<T, BLayoutCode> computer(args);
  const bool add_bias = args.bias != 0 && args.rank == args.bias_rank;
  const Range range = block_range(args.plan.tiles, args.compute_blocks, block);
  for (int64_t linear = range.begin; linear < range.end; ++linear) {
    const int64_t t = zigzag_tile(linear, args.plan.n_tiles);
    computer.run(tile_row(args.plan, t), tile_col(args.plan, t), add_bias);
    queue_publish(args, block, linear - range.begin, t);
  }
}

}  // namespace
}  // namespace device
}  // namespace gemm_ar

__global__ AICORE void GemmComputeKernel(__gm__ uint8_t* args_gm) {
  using namespace gemm_ar;
  KernelArgs args;
  device::load_kernel_args(args_gm, &args);
  const int64_t block = static_cast<int64_t>(get_block_idx());
  const int64_t launched = device::launched_block_count(args.compute_blocks);
  // Bad arguments are reported by the comm kernel, which checks the same things.
  if (!device::kernel_args_usable(args, launched, args.compute_blocks) || block >= args.compute_blocks) return;
  if (args.dtype == kDTypeFloat16) {
    if (args.b_layout == kBTransposed) {
      device::compute_all_tiles<kDTypeFloat16, kBTransposed>(args, block);
    } else {
      device::compute_all_tiles<kDTypeFloat16, kBRowMajor>(args, block);
    }
  } else {
    if (args.b_layout == kBTransposed) {
      device::compute_all_tiles<kDTypeBFloat16, kBTransposed>(args, block);
    } else {
      device::compute_all_tiles<kDTypeBFloat16, kBRowMajor>(args, block);
    }
  }
  pipe_barrier(PIPE_ALL);
}

#if !defined(__CPU_SIM)
#include "kernel_launch.h"

void gemm_ar::launch_gemm_compute(uint32_t block_dim, void* stream, void* args_device) {
  GemmComputeKernel<<<block_dim, nullptr, stream>>>(reinterpret_cast<__gm__ uint8_t*>(args_device));
}
#endif
