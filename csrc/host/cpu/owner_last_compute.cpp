// The compute side of gemm_allreduce and gemm_reduce_scatter on a rank with one core
// (CallJob::owner_reduces_in_compute). The comm blocks' way (every rank writes all its partials into its window, the
// owner reads them all back) costs the owner a write and a read of its own partial through memory; here the owner's
// own partial tile goes into a scratch (in cache for the usual 256-row tiles) and is reduced at once with the peers'
// partials (into the output, and for gemm_allreduce into the bank the peers copy from). The peers' tiles come first
// (they wait for them), the own tiles last: by then every peer has multiplied its part of them, so the waits below are
// short and cannot form a cycle (no rank waits before it has published every tile the others need). The
// reduction's rank order, and so every bit of the result, is that of the comm blocks' (reduce_rows).
// With CallJob::one_product the whole partial comes from one GEMM call into the window first (products that reorder
// B per call then reorder it once), the own tiles are reduced from the window, and the walk below only publishes
// and reduces. With CallJob::gathered_inputs (cpu/gathered_inputs.h) the rank's inputs go into the window first,
// the peers' tiles are only published, and each own tile is one product of every rank's inputs, copied into the bank.
#include <ATen/ATen.h>
#include <gemm_ar/protocol.hpp>

#include <vector>

#include "common/current_op.h"
#include "common/test_hooks.h"
#include "cpu/call_waits.h"
#include "cpu/fused_call.h"
#include "cpu/gathered_inputs.h"
#include "cpu/tile_kernels.h"

namespace gemm_ar::cpu {

namespace {

std::atomic<int64_t> one_product_calls{0};

// This rank's tiles in the walk order of the comm blocks' way (zigzag), the peers' tiles first.
std::vector<int64_t> owner_last_order(const CallJob& job) {
  const TilePlan& p = job.plan;
  std::vector<int64_t> order;
  order.reserve(p.tiles);
  for (const bool own : {false, true}) {
    for (int64_t linear = 0; linear < p.tiles; ++linear) {
      const int64_t t = zigzag_tile(linear, p.n_tiles);
      if ((run_owner_of(t, job.world, job.own_run) == job.rank) == own) order.push_back(t);
    }
  }
  return order;
}

}  // namespace

int64_t one_product_call_count() { return one_product_calls.load(std::memory_order_relaxed); }
void count_one_product_call() { one_product_calls.fetch_add(1, std::memory_order_relaxed); }

void multiply_whole_partial(const CallJob& job, uint8_t* partial) {
  const TilePlan& p = job.plan;
  job.gemm->compute(0, p.m, 0, p.n,
                    at::from_blob(partial, {p.m, p.n}, {p.pad_n, 1}, at::TensorOptions().dtype(job.partial_dtype)));
  count_one_product_call();
}

void run_owner_last_compute(CallJob& job, const std::function<bool()>& progress) {
  const bool scatter = job.op == kOpGemmReduceScatter;
  TORCH_CHECK(job.compute_blocks == 1 && (scatter || job.op == kOpGemmAllreduce), current_op(),
              ": internal: the owner-last walk is for one compute block of gemm_allreduce or "
              "gemm_reduce_scatter");
  const TilePlan& p = job.plan;
  const WindowLayout& w = job.layout;
  const std::vector<int64_t> order = owner_last_order(job);
  uint32_t* count = window_word(job.region(job.rank, queue_count_offset(w, 0)));
  const Doorbell queue_bell = doorbell(job.windows[job.rank], queue_comm_block(0, job.comm_blocks));
  const auto partial_options = at::TensorOptions().dtype(job.partial_dtype);
  // One tile of this rank's own partial, reused. Its rows are pad_n apart as in the window: the GEMM library picks
  // its kernel (and so its rounding) by the output's strides, and the tile must come out as the comm blocks' way has
  // it, bit for bit. Only rows x cols of it are touched (one tile: in cache for 256-row tiles; with column panels the
  // own tile has all M rows).
  at::Tensor scratch;
  at::Tensor gathered_a, gathered_b;  // the gathered-inputs flow's concatenated rows of a and columns of b
  std::vector<const uint8_t*> sources(job.world);
  try {
    // Before any tile flag: a peer that sees one may read the inputs (gathered_inputs_late breaks this on purpose).
    const bool late_inputs = job.gathered_inputs && test_hooks::gathered_inputs_late();
    if (job.gathered_inputs && !late_inputs) publish_gathered_inputs(job);
    if (job.one_product && p.m > 0) {
      multiply_whole_partial(job, job.region(job.rank, partial_entry_offset(w, 0, 0, p.pad_n, job.partial_elem)));
    }
    for (size_t i = 0; i < order.size(); ++i) {
      if (job.abort.load(std::memory_order_acquire)) return;
      const int64_t t = order[i];
      const int64_t mi = tile_row(p, t), ni = tile_col(p, t);
      const int64_t rows = chunked_tile_rows(p, job.chunks, mi), cols = tile_cols(p, ni);
      const int64_t row0 = chunked_tile_row0(p, job.chunks, mi), col0 = ni * p.base_n;
      if (job.one_product || job.gathered_inputs) {
        // Multiplied above, or the owner multiplies it: nothing to do for a peer's tile but publish it (below).
      } else if (run_owner_of(t, job.world, job.own_run) != job.rank) {
        // Padded position in the windows (mi * base_m); a's rows (row0) differ from it in row-chunked plans.
        const int64_t partial_offset = partial_entry_offset(w, mi * p.base_m, col0, p.pad_n, job.partial_elem);
        job.gemm->compute(row0, rows, col0, cols,
                          at::from_blob(job.region(job.rank, partial_offset), {rows, cols}, {p.pad_n, 1},
                                        partial_options));
      } else {
        // As long as one tile with rows pad_n apart, no longer.
        if (!scratch.defined()) scratch = at::empty({(p.base_m - 1) * p.pad_n + p.base_n}, partial_options);
        job.gemm->compute(row0, rows, col0, cols,
                          at::from_blob(scratch.data_ptr(), {rows, cols}, {p.pad_n, 1}, partial_options));
      }
      if (run_owner_of(t, job.world, job.own_run) == job.rank) {
        // The own partial first, then the wait: a rank with few or no peers' tiles to multiply would otherwise sit
        // idle until its peers finished theirs (at one tile per call, the two GEMMs would run one after the other).
        // Peers' data is read only once the call is agreed (comm block 0 checks the headers) and each peer's
        // partial of t is published (acquire, in tile_ready).
        const int64_t first_local = run_local_subtile(t, 0, job.world, p.stripes, job.own_run);
        bounded_wait(
            [&] {
              if (job.headers_checked.load(std::memory_order_acquire) != 1) return false;
              for (int r = 0; r < job.world; ++r)
                if (r != job.rank && !tile_ready(job, r, t)) return false;
              return true;
            },
            [&] { return progress ? progress() : false; },
            [&] { watch_peers(job, "call " + std::to_string(job.epoch)); }, [&] { return undelivered_tile(job, t); },
            doorbell(job.windows[job.rank], ag_block_of(first_local, job.comm_blocks)), job.timeout, &job.abort);
        // This rank's output holds only its own chunks when scattering; no peer copies a reduce-scatter's result.
        const int64_t out_row0 = scatter ? chunked_owner_row0(p, job.chunks, mi, job.world) : row0;
        // Every peer's inputs are in (its tile flag of t, acquire): the tile's rows in one product, into the output.
        if (job.gathered_inputs) multiply_gathered_rows(job, row0, rows, col0, cols, gathered_a, gathered_b);
        // Stripe by stripe: each stripe's final flag goes out as soon as it is reduced, and a row epilogue runs on
        // its rows while they are in cache (with full-width tiles a stripe holds whole rows).
        for (int64_t s = 0; s < p.stripes; ++s) {
          const int64_t stripe_rows = chunked_stripe_rows(p, job.chunks, mi, s);
          const int64_t l = run_local_subtile(t, s, job.world, p.stripes, job.own_run);
          const int64_t padded_row = mi * p.base_m + s * p.sub_m;  // the stripe's first row in the windows
          if (stripe_rows > 0 && job.gathered_inputs) {
            // The product is final: its stripe into the bank the peers copy from, unless they copy it from the
            // output itself (in a window slot).
            if (!job.out_in_slot) {
              copy_rows(job.out + ((out_row0 + s * p.sub_m) * p.n + col0) * job.out_elem, p.n * job.out_elem,
                        job.region(job.rank,
                                   reduced_entry_offset(w, job.bank, padded_row, col0, p.pad_n, job.out_elem)),
                        p.pad_n * job.out_elem, stripe_rows, cols * job.out_elem);
            }
          } else if (stripe_rows > 0) {
            for (int r = 0; r < job.world; ++r) {
              sources[r] =
                  r == job.rank && !job.one_product
                      ? static_cast<const uint8_t*>(scratch.data_ptr()) + s * p.sub_m * p.pad_n * job.partial_elem
                      : job.region(r, partial_entry_offset(w, padded_row, col0, p.pad_n, job.partial_elem));
            }
            uint8_t* out = job.out + ((out_row0 + s * p.sub_m) * p.n + col0) * job.out_elem;
            // No bank where no peer copies from it: a reduce-scatter's result, an output in a window slot.
            uint8_t* bank =
                scatter || job.out_in_slot
                    ? nullptr
                    : job.region(job.rank, reduced_entry_offset(w, job.bank, padded_row, col0, p.pad_n, job.out_elem));
            reduce_rows(ReduceRows{sources.data(), job.world, p.pad_n, job.partial_dtype, bank, p.pad_n, out, p.n,
                                   job.out_dtype, stripe_rows, cols, job.out_holds_addend});
          }
          // Peers' partial rows read, bank rows written: the subtile is final (release: a peer that sees the flag
          // may copy the bank and reuse its own window in its next call). Stripes wholly in the padding too.
          store_release(window_word(job.region(job.rank, final_entry_offset(w, l))), job.epoch);
          for (int r = 0; r < job.world; ++r)
            if (r != job.rank) ring_every_doorbell(job.windows[r], job.comm_blocks);
          if (job.row_epilogue && stripe_rows > 0) job.subtile_final(mi, s, out_row0 + s * p.sub_m, stripe_rows);
        }
      }
      // Entry, then the count with release order, as the comm blocks' way does (for an own tile the flag it turns
      // into is read by nobody; the count is what tells this rank's comm block that the GEMM is done).
      *window_word(job.region(job.rank, queue_entry_offset(w, 0, static_cast<int64_t>(i)))) = static_cast<uint32_t>(t);
      store_release(count, static_cast<uint32_t>(i + 1));
      queue_bell.ring();
      if (progress) progress();
    }
    if (late_inputs) publish_gathered_inputs(job);  // the deliberate bug: after every tile flag and this rank's product
  } catch (const LocalAbort&) {
  } catch (const std::exception& e) {
    job.fail(e.what(), false);
  }
}

}  // namespace gemm_ar::cpu
