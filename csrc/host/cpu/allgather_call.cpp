// allgather_gemm's parts of a fused call (cpu/fused_call.h): the shard publication, the comm blocks' copy plan,
// and the compute side that multiplies the local rows first and each peer's rows as they arrive (or, with
// CallJob::one_product, all rows at once where every peer's are in by then).
#include <ATen/Parallel.h>
#include <gemm_ar/protocol.hpp>

#include <algorithm>

#include "common/current_op.h"
#include "cpu/call_waits.h"
#include "cpu/fused_call.h"

namespace gemm_ar::cpu {

// allgather_gemm: one item per tile row of every peer's shard, peers in rank order starting after this rank (the
// order the compute blocks need them in), dealt round-robin over the comm blocks.
void plan_gather_work(CallJob& job) {
  const TilePlan& p = job.plan;
  const RowChunks& c = job.chunks;
  job.items.assign(job.comm_blocks, {});
  job.rows_arrived.reset(new std::atomic<uint32_t>[std::max<int64_t>(1, p.m_tiles)]);
  for (int64_t mi = 0; mi < p.m_tiles; ++mi) job.rows_arrived[mi].store(0, std::memory_order_relaxed);
  int64_t index = 0;
  for (int d = 1; d < job.world; ++d) {
    const int source = (job.rank + d) % job.world;
    for (int64_t g = source; g < c.count; g += job.world) {
      for (int64_t mi = g * c.m_tiles; mi < (g + 1) * c.m_tiles; ++mi) {
        if (chunked_tile_rows(p, c, mi) == 0) continue;
        job.items[index % job.comm_blocks].push_back(WorkItem{source, index, mi, 0, index});
        ++index;
      }
    }
  }
  job.copies_left.store(index, std::memory_order_relaxed);
}

// allgather_gemm's compute side: tile rows in the order local shard first, then each peer's (as plan_gather_work
// copies them), tiles dealt round-robin over the compute blocks; each tile of a peer's rows waits until they are
// copied. Results go straight into the output.
void run_gather_compute(CallJob& job, const std::function<bool()>& progress) {
  const TilePlan& p = job.plan;
  const RowChunks& c = job.chunks;
  std::vector<int64_t> order;
  order.reserve(p.tiles);
  for (int d = 0; d < job.world; ++d) {
    for (int64_t g = (job.rank + d) % job.world; g < c.count; g += job.world) {
      for (int64_t mi = g * c.m_tiles; mi < (g + 1) * c.m_tiles; ++mi) {
        if (chunked_tile_rows(p, c, mi) == 0) continue;
        for (int64_t j = 0; j < p.n_tiles; ++j) order.push_back(mi * p.n_tiles + (mi % 2 ? p.n_tiles - 1 - j : j));
      }
    }
  }
  const std::string call_name = "call " + std::to_string(job.epoch);
  const Doorbell bell = doorbell(job.windows[job.rank], kMainDoorbell);
  if (job.one_product && progress && p.m > 0) {
    // Where every peer's rows are in once this rank's are published and the ready copies made (ranks that arrive
    // together), one product of all rows: a GEMM that reorders all of B per call then reorders it once, not once per
    // rank's tile row. Otherwise tile by tile below, this rank's rows first.
    bool all_in = false;
    try {
      while (progress()) {
      }
      all_in = true;
      for (int64_t mi = 0; mi < p.m_tiles && all_in; ++mi) {
        all_in = chunked_tile_rows(p, c, mi) == 0 || job.rows_arrived[mi].load(std::memory_order_acquire) != 0;
      }
      if (all_in && !job.abort.load(std::memory_order_acquire)) {
        job.gemm->compute(0, p.m, 0, p.n, at::from_blob(job.out, {p.m, p.n}, at::TensorOptions().dtype(job.out_dtype)));
        count_one_product_call();
        progress();
      }
    } catch (const LocalAbort&) {
      return;
    } catch (const std::exception& e) {
      job.fail(e.what(), false);
      return;
    }
    if (all_in) return;
  }
  auto compute_block = [&](int64_t b) {
    try {
      for (size_t i = b; i < order.size(); i += job.compute_blocks) {
        if (job.abort.load(std::memory_order_acquire)) return;
        const int64_t t = order[i];
        const int64_t mi = tile_row(p, t), ni = tile_col(p, t);
        bounded_wait([&] { return job.rows_arrived[mi].load(std::memory_order_acquire) != 0; },
                     [&] { return progress ? progress() : false; }, [&] { watch_peers(job, call_name); },
                     [&] {
                       return current_op() + ": rank " + std::to_string(run_owner_of(mi, job.world, c.m_tiles)) +
                              " did not publish tile row " + std::to_string(mi) + " of its shard in " + call_name +
                              wait_bound(job);
                     },
                     bell, job.timeout, &job.abort);
        const int64_t row0 = chunked_tile_row0(p, c, mi), rows = chunked_tile_rows(p, c, mi);
        const int64_t col0 = ni * p.base_n, cols = tile_cols(p, ni);
        auto view = at::from_blob(job.out + (row0 * p.n + col0) * job.out_elem, {rows, cols}, {p.n, 1},
                                  at::TensorOptions().dtype(job.out_dtype));
        job.gemm->compute(row0, rows, col0, cols, view);
        if (progress) progress();
      }
    } catch (const LocalAbort&) {
    } catch (const std::exception& e) {
      job.fail(e.what(), false);
    }
  };
  at::parallel_for(0, job.compute_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) compute_block(b);
  });
}

void publish_shard(CallJob& job, const at::Tensor& a2d) {
  const TilePlan& p = job.plan;
  const RowChunks& c = job.chunks;
  const int64_t k = p.k;
  const auto options = at::TensorOptions().dtype(job.call->dtype);
  for (int64_t g = job.rank; g < c.count; g += job.world) {
    for (int64_t mi = g * c.m_tiles; mi < (g + 1) * c.m_tiles; ++mi) {
      const int64_t rows = chunked_tile_rows(p, c, mi);
      if (rows == 0) continue;
      const int64_t own_row0 = chunked_owner_row0(p, c, mi, job.world), row0 = chunked_tile_row0(p, c, mi);
      const at::Tensor src = a2d.narrow(0, own_row0, rows);
      if (k > 0) {
        at::from_blob(job.region(job.rank, shard_row_offset(job.layout, own_row0, k, job.a_elem)), {rows, k}, options)
            .copy_(src);
        at::from_blob(job.gathered + row0 * k * job.a_elem, {rows, k}, options).copy_(src);
        job.gemm->refresh_rows(row0, rows);
      }
      // The rows, then the flag (release): a peer that sees the flag sees the rows.
      store_release(window_word(job.region(job.rank, tile_flag_entry_offset(job.layout, mi))), job.epoch);
      job.rows_arrived[mi].store(1, std::memory_order_relaxed);  // read by this rank's compute blocks after a join
    }
  }
  for (int r = 0; r < job.world; ++r)
    if (r != job.rank) ring_every_doorbell(job.windows[r], job.comm_blocks);
}

}  // namespace gemm_ar::cpu
