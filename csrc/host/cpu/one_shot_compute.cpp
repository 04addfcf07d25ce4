// The one-shot reduction of a small gemm_allreduce on a rank with one core (CallJob::one_shot): every rank puts its
// whole partial product in its window's reduced bank of this call's parity, and every rank sums every rank's partials
// into its own output. One phase instead of reduce-scatter + all-gather: a rank waits only for its peers' partials,
// never for a peer's reduction. Each rank reads (world - 1) whole partials (two ranks read as much either way), so
// the engine takes it for small outputs only (kOneShotMaxReadBytes).
//
// Why the bank and not the partial region: peers read this rank's partials until they have reduced them, and
// nothing in this call tells this rank when that is. The banks alternate by call parity: every call e starts once
// every peer has started call e - 1 (FusedEngine::wait_for_previous_call), so has finished call e - 2, the last call
// that may have read bank e % 2.
//
// A peer's flag may already show call e + 1: nothing in this call holds a rank back once it has its peers'
// partials, so it may finish and publish its next call's partial before a slower peer looked. That partial went to
// the other bank, and that rank cannot write this bank again before this rank has started call e + 1. Any other
// value (a zeroed window, a flag of a call long ago) does not count.
//
// The sum runs in fixed rank order in fp32 from partials laid out as in the partial region (rows pad_n apart), so
// every rank's output, and every algorithm's, is bit for bit the same.
#include <ATen/ATen.h>
#include <gemm_ar/protocol.hpp>

#include <atomic>
#include <vector>

#include "common/current_op.h"
#include "common/test_hooks.h"
#include "cpu/call_header.h"
#include "cpu/call_waits.h"
#include "cpu/fused_call.h"
#include "cpu/tile_kernels.h"

namespace gemm_ar::cpu {

namespace {
std::atomic<int64_t> one_shot_calls{0}, decode_calls{0};
}  // namespace

int64_t one_shot_call_count() { return one_shot_calls.load(std::memory_order_relaxed); }
int64_t decode_call_count() { return decode_calls.load(std::memory_order_relaxed); }

void run_one_shot_compute(CallJob& job, const std::function<bool()>& progress) {
  TORCH_CHECK(job.compute_blocks == 1 && job.op == kOpGemmAllreduce, current_op(),
              ": internal: the one-shot reduction is for one compute block of gemm_allreduce");
  const TilePlan& p = job.plan;
  const WindowLayout& w = job.layout;
  uint32_t* count = window_word(job.region(job.rank, queue_count_offset(w, 0)));
  const Doorbell queue_bell = doorbell(job.windows[job.rank], queue_comm_block(0, job.comm_blocks));
  const auto partial_options = at::TensorOptions().dtype(job.partial_dtype);
  const int64_t bank = test_hooks::one_shot_single_bank() ? 0 : job.bank;
  auto bank_entry = [&](int r, int64_t padded_row, int64_t col0) {
    return job.region(r, reduced_entry_offset(w, bank, padded_row, col0, p.pad_n, job.partial_elem));
  };
  one_shot_calls.fetch_add(1, std::memory_order_relaxed);
  if (job.decode) decode_calls.fetch_add(1, std::memory_order_relaxed);
  // Rank r's partial of tile t is in its bank: the flag shows this call or the next (see above).
  auto published = [&](int r, int64_t t) {
    const uint32_t flag = load_acquire(window_word(job.region(r, tile_flag_entry_offset(w, t))));
    return job.ignore_epochs ? flag != 0 : flag == job.epoch || flag == job.epoch + 1u;
  };
  std::vector<const uint8_t*> sources(job.world);
  // A decode call waits for its peers at most about one GEMM of theirs, and is short: a rank that slept there would
  // come back a futex wake-up later, which is the size of the call's whole communication. So it spins as long as a
  // tuning call's agreement does before sleeping (shm_sync.h, kAlignSpins), yielding now and then (call_waits.h).
  const int spins = job.decode ? kAlignSpins : kWaitSpins;
  try {
    // Every tile's partial first: peers wait for all of them. In one GEMM call where the geometry asks for it.
    if (job.one_product && p.m > 0) {
      if (job.abort.load(std::memory_order_acquire)) return;
      multiply_whole_partial(job, bank_entry(job.rank, 0, 0));
    }
    for (int64_t i = 0; i < p.tiles && !job.one_product; ++i) {
      if (job.abort.load(std::memory_order_acquire)) return;
      const int64_t t = zigzag_tile(i, p.n_tiles);
      const int64_t mi = tile_row(p, t), ni = tile_col(p, t);
      const int64_t rows = chunked_tile_rows(p, job.chunks, mi), cols = tile_cols(p, ni);
      const int64_t row0 = chunked_tile_row0(p, job.chunks, mi), col0 = ni * p.base_n;
      job.gemm->compute(row0, rows, col0, cols,
                        at::from_blob(bank_entry(job.rank, mi * p.base_m, col0), {rows, cols}, {p.pad_n, 1},
                                      partial_options));
    }
    // Published only once this rank has read every peer's header of this call (comm block 0 checks them): a peer
    // then leaves the call only after this rank has, and cannot overwrite that header slot (call e + 2) before this
    // rank read it, even when its next call raises at once (the two-phase way gets this from the owners' reductions).
    bounded_wait([&] { return job.headers_checked.load(std::memory_order_acquire) == 1; },
                 [&] { return progress ? progress() : false; },
                 [&] { watch_peers(job, "call " + std::to_string(job.epoch)); },
                 [&] {
                   return late_ranks(job.world, job.rank,
                                     [&](int r) { return !started_call(job.windows[r], job.epoch); }) +
                          " did not arrive at call " + std::to_string(job.epoch) + wait_bound(job);
                 },
                 doorbell(job.windows[job.rank], 0), job.timeout, &job.abort, spins);
    for (int64_t i = 0; i < p.tiles; ++i) {
      const int64_t t = zigzag_tile(i, p.n_tiles);
      // The partial, then its flag (release: a peer that sees the flag sees the rows), then every peer's doorbell.
      store_release(window_word(job.region(job.rank, tile_flag_entry_offset(w, t))), job.epoch);
      for (int r = 0; r < job.world; ++r)
        if (r != job.rank) ring_every_doorbell(job.windows[r], job.comm_blocks);
      // The queue entry tells this rank's comm block that the GEMM is done (it publishes the same flag again).
      *window_word(job.region(job.rank, queue_entry_offset(w, 0, i))) = static_cast<uint32_t>(t);
      store_release(count, static_cast<uint32_t>(i + 1));
    }
    queue_bell.ring();
    for (int64_t i = 0; i < p.tiles; ++i) {
      const int64_t t = zigzag_tile(i, p.n_tiles);
      const int64_t mi = tile_row(p, t), ni = tile_col(p, t);
      const int64_t rows = chunked_tile_rows(p, job.chunks, mi), cols = tile_cols(p, ni);
      const int64_t row0 = chunked_tile_row0(p, job.chunks, mi), col0 = ni * p.base_n;
      // Peers' partials are read only once the call is agreed (checked above) and each is published (acquire).
      bounded_wait(
          [&] {
            for (int r = 0; r < job.world; ++r)
              if (r != job.rank && !published(r, t)) return false;
            return true;
          },
          [&] { return progress ? progress() : false; }, [&] { watch_peers(job, "call " + std::to_string(job.epoch)); },
          [&] {
            return late_ranks(job.world, job.rank, [&](int r) { return !published(r, t); }) +
                   " did not deliver their partial of tile " + std::to_string(t) + " of call " +
                   std::to_string(job.epoch) + " (one-shot reduction)" + wait_bound(job);
          },
          doorbell(job.windows[job.rank], 0), job.timeout, &job.abort, spins);
      // Stripe by stripe, as the two-phase way reduces: a row epilogue (add+RMSNorm) runs on a stripe's rows once
      // every tile of its row block is summed, while they are in cache. In place (out_holds_addend) each rank adds
      // the rounded sum into its own residual, as a peer copying the two-phase way's bank does: the same bits.
      for (int64_t s = 0; s < p.stripes; ++s) {
        const int64_t stripe_rows = chunked_stripe_rows(p, job.chunks, mi, s);
        if (stripe_rows <= 0) continue;
        for (int r = 0; r < job.world; ++r) sources[r] = bank_entry(r, mi * p.base_m + s * p.sub_m, col0);
        const int64_t out_row = row0 + s * p.sub_m;
        reduce_rows(ReduceRows{sources.data(), job.world, p.pad_n, job.partial_dtype, nullptr, p.pad_n,
                               job.out + (out_row * p.n + col0) * job.out_elem, p.n, job.out_dtype, stripe_rows, cols,
                               job.out_holds_addend});
        if (job.row_epilogue) job.subtile_final(mi, s, out_row, stripe_rows);
      }
    }
  } catch (const LocalAbort&) {
  } catch (const std::exception& e) {
    job.fail(e.what(), false);
  }
}

}  // namespace gemm_ar::cpu
