// GemmRsComputeKernel / AgGemmComputeKernel (cube cores): the products of the sequence-parallel ops, tile by tile,
// into the scratch's partial buffer, each finished tile published in the block's ready queue
// (gemm_ar/sequence_parallel.hpp has the row-chunked plan and the walk).
//
// Block b walks items b, b + P, ... of sp_item_tile's order. Tile t of the plan, in row chunk g, is computed by
// TileComputer (tile_computer.hpp) from
//  - reduce-scatter: a's rows of the tile row (a holds every chunk); the bias once, on bias_rank (the owner's sum
//    holds it once);
//  - allgather: this rank's a for its own shard (chunk g = rank); a peer's shard from the gathered buffer in the
//    scratch, after this rank's comm kernel raised the tile row's row-ready flag (a bounded wait, then
//    acquire_fence); the bias on every rank (each computes its whole output).
#include <pto/pto-inst.hpp>

#include "device_support.hpp"
#include "ready_queue.hpp"
#include "remote_window.hpp"
#include "sp_kernel_entry.h"
#include "tile_computer.hpp"

namespace gemm_ar {
namespace device {
namespace {

// Bounded wait for this rank's comm kernel to have pulled tile row mi (of rank `shard`'s chunk). False when the
// call failed (recorded here, or by the block that failed first).
AICORE inline bool wait_row_ready(const KernelArgs& args, const RemoteWindows& win, int64_t block, int32_t shard,
                                  int64_t mi) {
  __gm__ uint32_t* flag = win.local<uint32_t>(ag_row_ready_flag_offset(allgather_layout(args.layout), mi));
  const uint32_t tag = signal_tag(args.epoch);
  const uint32_t tag_high = signal_tag_high(args.epoch);
  const uint64_t timeout = args.wait_timeout_us != 0 ? args.wait_timeout_us : kDefaultWaitTimeoutUs;
  const uint64_t start = now_us();
  while (!flag_raised(flag, tag, tag_high)) {
    if (aborted(args)) return false;
    if (now_us() - start > timeout) {
      report_error(args, kErrTimeoutRows, shard, mi % args.chunks.m_tiles, static_cast<int32_t>(block), 0);
      return false;
    }
    idle_pause();
  }
  if (site_kept(kControlAgRowAcquire)) acquire_fence();
  return true;
}

template <uint32_t DType, uint32_t BLayoutCode>
AICORE inline void compute_sp_items(const KernelArgs& args, int64_t block, uint32_t op) {
  using T = typename ElemOf<DType>::type;
  const TilePlan& p = args.plan;
  const RowChunks& c = args.chunks;
  RemoteWindows win;
  if (op == kOpAllgatherGemm && !win.init(args)) return;  // the comm kernel finds and reports the same context
  const bool add_bias = args.bias != 0 && (op == kOpAllgatherGemm || args.rank == args.bias_rank);
  TileComputer<T, BLayoutCode> computer(args);
  int64_t ready_row = -1;  // the tile row last waited for (consecutive tiles of a row wait once)
  const int64_t items = sp_block_item_count(p, args.compute_blocks, block);
  for (int64_t j = 0; j < items; ++j) {
    const int64_t t = sp_block_item(p, c, args.rank, op, args.compute_blocks, block, j);
    const int64_t mi = tile_row(p, t);
    const int32_t g = static_cast<int32_t>(chunk_of_tile_row(c, mi));
    ARows src{args.a, args.lda, chunked_tile_row0(p, c, mi)};  // reduce-scatter: a holds every chunk's rows
    if (op == kOpAllgatherGemm && g == args.rank) {
      src.row0 = chunked_owner_row0(p, c, mi, args.world);  // the caller's a is this rank's shard alone
    } else if (op == kOpAllgatherGemm) {
      if (mi != ready_row) {
        if (site_kept(kControlAgNoRowWait) && !wait_row_ready(args, win, block, g, mi)) return;
        ready_row = mi;
      }
      note_guarded_access();  // the gathered rows the row-ready flag published
      // The gathered a: every shard, packed (ld k).
      src = ARows{args.scratch + static_cast<uint64_t>(allgather_layout(args.layout).gathered_offset), p.k,
                  chunked_tile_row0(p, c, mi)};
    }
    computer.run(mi, tile_col(p, t), add_bias, src);
    queue_publish(args, block, j, t);
  }
}

template <uint32_t DType>
AICORE inline void compute_sp_items_for(const KernelArgs& args, int64_t block, uint32_t op) {
  if (args.b_layout == kBTransposed) {
    compute_sp_items<DType, kBTransposed>(args, block, op);
  } else {
    compute_sp_items<DType, kBRowMajor>(args, block, op);
  }
}

AICORE inline void sp_compute_main(__gm__ uint8_t* args_gm, uint32_t op) {
  KernelArgs args{};  // zeroed: g++ cannot follow the word-by-word load and warns of uninitialised fields
  load_kernel_args(args_gm, &args);
  const int64_t block = static_cast<int64_t>(get_block_idx());
  const int64_t launched = launched_block_count(args.compute_blocks);
  // Bad arguments are reported by the comm kernel, which checks the same things.
  if (!kernel_args_usable(args, launched, args.compute_blocks, op) || block >= args.compute_blocks) return;
  if (args.dtype == kDTypeFloat16) {
    compute_sp_items_for<kDTypeFloat16>(args, block, op);
  } else {
    compute_sp_items_for<kDTypeBFloat16>(args, block, op);
  }
  pipe_barrier(PIPE_ALL);
}

}  // namespace
}  // namespace device
}  // namespace gemm_ar

__global__ AICORE void GemmRsComputeKernel(__gm__ uint8_t* args_gm) {
  gemm_ar::device::sp_compute_main(args_gm, gemm_ar::kOpGemmReduceScatter);
}

__global__ AICORE void AgGemmComputeKernel(__gm__ uint8_t* args_gm) {
  gemm_ar::device::sp_compute_main(args_gm, gemm_ar::kOpAllgatherGemm);
}

#if !defined(__CPU_SIM)
#include "sp_kernel_launch.h"

void gemm_ar::launch_rs_compute(uint32_t block_dim, void* stream, void* args_device) {
  GemmRsComputeKernel<<<block_dim, nullptr, stream>>>(reinterpret_cast<__gm__ uint8_t*>(args_device));
}

void gemm_ar::launch_ag_compute(uint32_t block_dim, void* stream, void* args_device) {
  AgGemmComputeKernel<<<block_dim, nullptr, stream>>>(reinterpret_cast<__gm__ uint8_t*>(args_device));
}
#endif
