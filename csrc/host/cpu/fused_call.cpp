#include "cpu/fused_call.h"

#include <ATen/Parallel.h>
#include <gemm_ar/protocol.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "common/current_op.h"
#include "common/test_hooks.h"
#include "cpu/call_header.h"
#include "cpu/call_waits.h"
#include "cpu/shared_outputs.h"
#include "cpu/tile_kernels.h"

namespace gemm_ar::cpu {

void CallJob::subtile_final(int64_t mi, int64_t stripe, int64_t row0, int64_t rows) {
  const int64_t done = row_block_done[mi * plan.stripes + stripe].fetch_add(1, std::memory_order_acq_rel) + 1;
  if (done == plan.n_tiles) row_epilogue(out, row0, rows);
}

void CallJob::fail(const std::string& message, bool disagreement) {
  {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (!error.empty()) return;
    error = message;
    error_is_disagreement = disagreement;
  }
  abort.store(true, std::memory_order_release);
  if (!disagreement) {  // peers reach a disagreement verdict on their own; anything else they must be told
    publish_abort(windows[rank], epoch);
    for (int r = 0; r < world; ++r) ring_every_doorbell(windows[r], comm_blocks);
  } else {
    ring_every_doorbell(windows[rank], comm_blocks);
  }
}

namespace {

// Reads every peer's header for `epoch` without waiting; true once all have arrived (signatures in `all`).
bool poll_signatures(const std::vector<uint8_t*>& windows, const WindowSet& window_set, int rank, uint32_t epoch,
                     std::vector<CallSignature>& all, std::vector<char>& arrived) {
  bool done = true;
  for (size_t r = 0; r < windows.size(); ++r) {
    if (arrived[r]) continue;
    switch (read_header(windows[r], epoch, &all[r])) {
      case PeerCallState::kArrived: arrived[r] = 1; break;
      case PeerCallState::kNotYet: done = false; break;
      case PeerCallState::kAbandoned:
        // A peer abandons the call when it finds a rank dead: name the dead rank here too, not only the messenger.
        window_set.check_peers_alive(("before call " + std::to_string(epoch)).c_str());
        throw CallRejected(current_op() + ": rank " + std::to_string(r) + " abandoned call " + std::to_string(epoch) +
                           " before it started (see that rank's error) [rank " + std::to_string(rank) + "]");
    }
  }
  return done;
}

std::string missing_ranks(const std::vector<char>& arrived, uint32_t epoch, std::chrono::milliseconds timeout,
                          int rank) {
  std::ostringstream os;
  os << late_ranks(static_cast<int>(arrived.size()), -1, [&](int r) { return !arrived[r]; })
     << " did not arrive at call " << epoch << " within " << timeout.count() / 1000.0
     << " s (TORCH_GEMM_AR_TIMEOUT_S) [rank " << rank << "]";
  return os.str();
}

}  // namespace

std::vector<CallSignature> gather_signatures(const std::vector<uint8_t*>& windows, const WindowSet& window_set,
                                             int rank, uint32_t epoch, const CallSignature& mine,
                                             std::chrono::milliseconds timeout, Doorbell bell,
                                             const std::atomic<bool>* stop, int max_spins) {
  std::vector<CallSignature> all(windows.size());
  std::vector<char> arrived(windows.size(), 0);
  all[rank] = mine;
  arrived[rank] = 1;
  const std::string context = "before call " + std::to_string(epoch);
  bounded_wait([&] { return poll_signatures(windows, window_set, rank, epoch, all, arrived); }, no_progress,
               [&] { window_set.check_peers_alive(context.c_str()); },
               [&] { return missing_ranks(arrived, epoch, timeout, rank); }, bell, timeout, stop, max_spins);
  return all;
}

void plan_work(CallJob& job) {
  if (job.op == kOpAllgatherGemm) return plan_gather_work(job);
  const TilePlan& p = job.plan;
  const int64_t stripes = p.stripes;
  std::vector<int64_t> block_begin(job.compute_blocks);
  for (int64_t b = 0; b < job.compute_blocks; ++b) block_begin[b] = block_range(p.tiles, job.compute_blocks, b).begin;
  job.items.assign(job.comm_blocks, {});
  // One shot: the compute block reads every peer's partial itself, nothing to gather.
  for (int owner = 0; owner < job.world && !job.one_shot; ++owner) {
    if (job.owner_reduces_in_compute && owner == job.rank) continue;  // the compute block reduces them
    const int64_t owned = run_owned_tile_count(p.tiles, job.world, owner, job.own_run) * stripes;
    for (int64_t l = 0; l < owned; ++l) {
      const int64_t t = run_subtile_tile(l, owner, job.world, stripes, job.own_run);
      const int64_t stripe = subtile_stripe(l, stripes);
      if (chunked_stripe_rows(p, job.chunks, tile_row(p, t), stripe) == 0) continue;  // all padding: nothing to move
      const int64_t linear = zigzag_linear(t, p.n_tiles);
      const int64_t block = std::upper_bound(block_begin.begin(), block_begin.end(), linear) - block_begin.begin() - 1;
      job.items[ag_block_of(l, job.comm_blocks)].push_back(WorkItem{owner, l, t, stripe, linear - block_begin[block]});
    }
  }
  if (job.row_epilogue) {
    const int64_t row_blocks = p.m_tiles * stripes;
    job.row_block_done.reset(new std::atomic<int64_t>[row_blocks]);
    for (int64_t i = 0; i < row_blocks; ++i) job.row_block_done[i].store(0, std::memory_order_relaxed);
  }
  // In the order tiles are produced (the same schedule on every rank); at equal times this rank's own reductions
  // first (peers wait on them), then the other owners in an order rotated by rank so that ranks do not all read
  // from the same owner at once.
  for (auto& items : job.items) {
    std::stable_sort(items.begin(), items.end(), [&](const WorkItem& x, const WorkItem& y) {
      const int dx = (x.owner - job.rank + job.world) % job.world, dy = (y.owner - job.rank + job.world) % job.world;
      return x.step != y.step ? x.step < y.step : dx < dy;
    });
  }
}

void run_compute_blocks(CallJob& job, const std::function<bool()>& progress) {
  if (job.op == kOpAllgatherGemm) return run_gather_compute(job, progress);
  if (job.one_shot) return run_one_shot_compute(job, progress);
  if (job.owner_reduces_in_compute) return run_owner_last_compute(job, progress);
  const TilePlan& p = job.plan;
  const WindowLayout& w = job.layout;
  auto compute_block = [&](int64_t b) {
    const Range range = block_range(p.tiles, job.compute_blocks, b);
    uint32_t* count = window_word(job.region(job.rank, queue_count_offset(w, b)));
    const Doorbell bell = doorbell(job.windows[job.rank], queue_comm_block(b, job.comm_blocks));
    for (int64_t i = 0; i < range.end - range.begin; ++i) {
      if (job.abort.load(std::memory_order_acquire)) return;
      const int64_t t = zigzag_tile(range.begin + i, p.n_tiles);
      const int64_t mi = tile_row(p, t), ni = tile_col(p, t);
      const int64_t rows = chunked_tile_rows(p, job.chunks, mi), cols = tile_cols(p, ni);
      const int64_t col0 = ni * p.base_n;
      // Padded position in the window (mi * base_m); the rows of a (row0) differ from it in row-chunked plans.
      auto view =
          at::from_blob(job.region(job.rank, partial_entry_offset(w, mi * p.base_m, col0, p.pad_n, job.partial_elem)),
                        {rows, cols}, {p.pad_n, 1}, at::TensorOptions().dtype(job.partial_dtype));
      job.gemm->compute(chunked_tile_row0(p, job.chunks, mi), rows, col0, cols, view);
      // Payload, then the entry, then the count with release order: the comm block sees a finished tile.
      *window_word(job.region(job.rank, queue_entry_offset(w, b, i))) = static_cast<uint32_t>(t);
      store_release(count, static_cast<uint32_t>(i + 1));
      bell.ring();
      if (progress) progress();
    }
  };
  at::parallel_for(0, job.compute_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) compute_block(b);
  });
}

namespace {

// The comm side of one comm block, resumable: poll() does what is ready without waiting (so the compute thread
// can run it between tiles when the rank has no core to spare for a comm thread); finish() completes the call
// with bounded waits. The work and its order are the same either way.
class CommBlock {
 public:
  CommBlock(CallJob& job, int64_t c)
      : job_(job), c_(c), p_(job.plan), w_(job.layout), me_(job.rank), world_(job.world), epoch_(job.epoch),
        bell_(doorbell(job.windows[job.rank], c)), call_name_("call " + std::to_string(job.epoch)), all_(job.world),
        arrived_(job.world, 0), sources_(job.world) {
    all_[me_] = job.signature;
    arrived_[me_] = 1;
    if (job.op == kOpAllgatherGemm) return;  // no ready queues: its tiles go straight into the output
    for (int64_t j = 0; j < comm_block_queue_count(c, job.compute_blocks, job.comm_blocks); ++j) {
      const int64_t b = comm_block_queue(c, j, job.comm_blocks);
      const Range range = block_range(p_.tiles, job.compute_blocks, b);
      queues_.push_back(Queue{window_word(job.region(me_, queue_count_offset(w_, b))), b, 0, range.end - range.begin});
    }
  }

  bool poll() {
    bool any = drain();
    if (!validated_ && !try_validate()) return any;
    const auto& items = job_.items[c_];
    while (next_ < items.size() && ready(items[next_])) {
      run_item(items[next_++]);
      any = true;
    }
    return any;
  }

  void finish() {
    if (!validated_) {
      bounded_wait([&] { return try_validate(); }, [&] { return drain(); }, [&] { watch(); },
                   [&] {
                     return c_ == 0 ? missing_ranks(arrived_, epoch_, job_.timeout, me_)
                                    : (current_op() + ": internal: call header check did not finish");
                   },
                   bell_, job_.timeout, &job_.abort);
    }
    // Overlap off: comm after the whole GEMM, the "sequential (same engine)" row of
    // docs/decisions/0012-benchmark-measures.md.
    if (!job_.overlap && job_.op != kOpAllgatherGemm) {
      bounded_wait([&] { return job_.compute_done.load(std::memory_order_acquire); }, no_progress, [&] { watch(); },
                   [&] { return current_op() + ": the GEMM did not finish in time"; }, bell_, job_.timeout,
                   &job_.abort);
    }
    const auto& items = job_.items[c_];
    for (; next_ < items.size(); ++next_) {
      const WorkItem& item = items[next_];
      bounded_wait([&] { return ready(item); }, [&] { return drain(); }, [&] { watch(); }, [&] { return late(item); },
                   bell_, job_.timeout, &job_.abort);
      run_item(item);
    }
    // Every local tile must reach its owner, even when this block has nothing left to gather.
    bounded_wait(
        [&] {
          for (const auto& q : queues_)
            if (q.consumed < q.expected) return false;
          return true;
        },
        [&] { return drain(); }, [&] { watch(); },
        [&] { return current_op() + ": the local GEMM did not finish " + call_name_ + " in time"; }, bell_,
        job_.timeout, &job_.abort);
    if (job_.op == kOpAllgatherGemm && c_ == 0) finish_gather();
  }

 private:
  struct Queue {
    uint32_t* count;
    int64_t block, consumed, expected;
  };

  // Agree on the call before touching any peer's data: block 0 checks every header, the others wait for it.
  bool try_validate() {
    if (c_ != 0) return validated_ = job_.headers_checked.load(std::memory_order_acquire) == 1;
    if (!poll_signatures(job_.windows, *job_.window_set, me_, epoch_, all_, arrived_)) return false;
    std::string problem = diagnose_signatures(all_, me_, *job_.call, job_.group_name);
    if (!problem.empty()) throw CallRejected(problem);
    job_.headers_checked.store(1, std::memory_order_release);
    for (int64_t other = 1; other < job_.comm_blocks; ++other) doorbell(job_.windows[me_], other).ring();
    return validated_ = true;
  }

  void watch() const { watch_peers(job_, call_name_); }

  // allgather_gemm: once every peer's rows are here, says so in this rank's window (its first final flag), then
  // waits until every peer has said so: only then may a next call overwrite this rank's shard. A flag at a later
  // call counts too (that peer has moved on, so it finished this one).
  void finish_gather() {
    bounded_wait([&] { return job_.copies_left.load(std::memory_order_acquire) == 0; }, no_progress, [&] { watch(); },
                 [&] { return current_op() + ": internal: shard copies did not finish"; }, bell_, job_.timeout,
                 &job_.abort);
    store_release(window_word(job_.region(me_, final_entry_offset(w_, 0))), epoch_);
    for (int r = 0; r < world_; ++r)
      if (r != me_) doorbell(job_.windows[r], 0).ring();
    auto done = [&](int r) {
      return counter_reached(load_acquire(window_word(job_.region(r, final_entry_offset(w_, 0)))), epoch_);
    };
    bounded_wait(
        [&] {
          for (int r = 0; r < world_; ++r)
            if (!done(r)) return false;
          return true;
        },
        no_progress, [&] { watch(); },
        [&] {
          return late_ranks(world_, -1, [&](int r) { return !done(r); }) +
                 " did not finish copying this rank's shard in " + call_name_ + " within " +
                 std::to_string(job_.timeout.count() / 1000.0) + " s (TORCH_GEMM_AR_TIMEOUT_S) [rank " +
                 std::to_string(me_) + "]";
        },
        bell_, job_.timeout, &job_.abort);
  }

  // Publishes this block's finished local tiles to their owners.
  bool drain() {
    bool any = false;
    for (auto& q : queues_) {
      const uint32_t available = load_acquire(q.count);
      for (; q.consumed < available; ++q.consumed) {
        publish_tile(*window_word(job_.region(me_, queue_entry_offset(w_, q.block, q.consumed))));
        any = true;
      }
    }
    return any;
  }

  void publish_tile(int64_t t) {
    store_release(window_word(job_.region(me_, tile_flag_entry_offset(w_, t))), epoch_);
    const int owner = static_cast<int>(run_owner_of(t, world_, job_.own_run));
    uint64_t rung = 0;
    for (int64_t s = 0; s < p_.stripes; ++s) {
      const int64_t block = ag_block_of(run_local_subtile(t, s, world_, p_.stripes, job_.own_run), job_.comm_blocks);
      if (rung & (uint64_t{1} << block)) continue;
      rung |= uint64_t{1} << block;
      doorbell(job_.windows[owner], block).ring();
    }
  }

  bool tile_ready(int r, int64_t t) const { return gemm_ar::cpu::tile_ready(job_, r, t); }
  bool ready(const WorkItem& item) const {
    if (job_.op == kOpAllgatherGemm) return tile_ready(item.owner, item.tile);  // the shard's tile row flag
    if (item.owner != me_) {
      return is_current(job_,
                        load_acquire(window_word(job_.region(item.owner, final_entry_offset(w_, item.local_id)))));
    }
    for (int r = 0; r < world_; ++r)
      if (!tile_ready(r, item.tile)) return false;
    return true;
  }

  std::string late(const WorkItem& item) const {
    if (job_.op == kOpAllgatherGemm) {
      return current_op() + ": rank " + std::to_string(item.owner) + " did not publish tile row " +
             std::to_string(item.tile) + " of its shard in " + call_name_ + wait_bound(job_);
    }
    if (item.owner != me_) {
      return current_op() + ": rank " + std::to_string(item.owner) + " did not finish its subtile " +
             std::to_string(item.local_id) + " of " + call_name_ + wait_bound(job_);
    }
    return undelivered_tile(job_, item.tile);
  }

  // allgather_gemm: copies a tile row of a peer's shard into the gathered a; the compute blocks may use it then.
  void copy_shard_rows(const WorkItem& item) {
    const int64_t mi = item.tile, k = p_.k;
    const int64_t rows = chunked_tile_rows(p_, job_.chunks, mi), row0 = chunked_tile_row0(p_, job_.chunks, mi);
    const int64_t src_row0 = chunked_owner_row0(p_, job_.chunks, mi, world_);
    if (k > 0) {
      std::memcpy(job_.gathered + row0 * k * job_.a_elem,
                  job_.region(item.owner, shard_row_offset(w_, src_row0, k, job_.a_elem)), rows * k * job_.a_elem);
      job_.gemm->refresh_rows(row0, rows);
    }
    job_.rows_arrived[mi].store(1, std::memory_order_release);
    doorbell(job_.windows[me_], kMainDoorbell).ring();
    if (job_.copies_left.fetch_sub(1, std::memory_order_acq_rel) == 1) doorbell(job_.windows[me_], 0).ring();
  }

  // Reduces a subtile this rank owns (fixed rank order) or copies another owner's finished one (gemm_allreduce
  // only: in gemm_reduce_scatter the other owners' rows are not this rank's output).
  void run_item(const WorkItem& item) {
    if (job_.op == kOpAllgatherGemm) return copy_shard_rows(item);
    const bool scatter = job_.op == kOpGemmReduceScatter;
    if (scatter && item.owner != me_) return;
    const int64_t mi = tile_row(p_, item.tile), ni = tile_col(p_, item.tile);
    // Padded position in the windows, and where the rows go in the output (this rank's chunks only, when scattering).
    const int64_t padded_row0 = mi * p_.base_m + item.stripe * p_.sub_m, col0 = ni * p_.base_n;
    const int64_t row0 =
        (scatter ? chunked_owner_row0(p_, job_.chunks, mi, world_) : chunked_tile_row0(p_, job_.chunks, mi)) +
        item.stripe * p_.sub_m;
    const int64_t rows = chunked_stripe_rows(p_, job_.chunks, mi, item.stripe), cols = tile_cols(p_, ni);
    uint8_t* out = job_.out + (row0 * p_.n + col0) * job_.out_elem;
    const int64_t bank_offset = reduced_entry_offset(w_, job_.bank, padded_row0, col0, p_.pad_n, job_.out_elem);
    if (item.owner != me_) {
      // The owner's rows: in its output where it has one in a window slot (the word is ordered by the final flag's
      // acquire in ready()), otherwise in its bank.
      if (const int64_t delay = test_hooks::peer_copy_delay_us(); delay > 0)
        std::this_thread::sleep_for(std::chrono::microseconds(delay));
      const uint32_t slot = read_output_slot(job_.windows[item.owner], job_.bank);
      const uint8_t* source = job_.region(item.owner, bank_offset);
      int64_t stride = p_.pad_n;
      if (slot != kRowsInBank) {
        TORCH_CHECK(slot <= static_cast<uint32_t>(job_.output_slots) && job_.output_slot_bytes > 0, current_op(),
                    ": rank ", item.owner, " names output slot ", slot, " that the windows do not have [rank ", me_,
                    "]");
        source = job_.windows[item.owner] +
                 output_slot_offset(job_.output_slots_offset, job_.output_slot_bytes, static_cast<int>(slot) - 1) +
                 (row0 * p_.n + col0) * job_.out_elem;
        stride = p_.n;
      }
      if (job_.out_holds_addend) {
        add_rows_into(source, stride, out, p_.n, rows, cols, job_.out_dtype);
      } else {
        copy_rows(source, stride * job_.out_elem, out, p_.n * job_.out_elem, rows, cols * job_.out_elem);
      }
    } else {
      for (int r = 0; r < world_; ++r)
        sources_[r] = job_.region(r, partial_entry_offset(w_, padded_row0, col0, p_.pad_n, job_.partial_elem));
      // No bank where no peer copies from it: a reduce-scatter's result, an output in a window slot.
      reduce_rows(ReduceRows{sources_.data(), world_, p_.pad_n, job_.partial_dtype,
                             scatter || job_.out_in_slot ? nullptr : job_.region(me_, bank_offset), p_.pad_n, out, p_.n,
                             job_.out_dtype, rows, cols, job_.out_holds_addend});
      store_release(window_word(job_.region(me_, final_entry_offset(w_, item.local_id))), epoch_);
      for (int64_t i = 0; i + 1 < world_; ++i)
        doorbell(job_.windows[rotated_peer(me_, item.local_id, i, world_)], c_).ring();
    }
    if (job_.row_epilogue) job_.subtile_final(mi, item.stripe, row0, rows);
  }

  CallJob& job_;
  const int64_t c_;
  const TilePlan& p_;
  const WindowLayout& w_;
  const int me_, world_;
  const uint32_t epoch_;
  const Doorbell bell_;
  const std::string call_name_;
  std::vector<CallSignature> all_;
  std::vector<char> arrived_;
  std::vector<const uint8_t*> sources_;
  std::vector<Queue> queues_;
  size_t next_ = 0;
  bool validated_ = false;
};

// Records an error of a comm block in the job (never throws).
template <class Body>
void guarded(CallJob& job, Body body) {
  try {
    body();
  } catch (const LocalAbort&) {
    // Another block of this rank failed first and recorded the reason.
  } catch (const CallRejected& e) {
    job.fail(e.what(), /*disagreement=*/true);
  } catch (const std::exception& e) {
    job.fail(e.what(), /*disagreement=*/false);
  }
}

}  // namespace

void run_comm_block(CallJob& job, int64_t c) {
  const CurrentOp op(job.call->op_name);  // a comm thread: its errors name the call's op
  guarded(job, [&] { CommBlock(job, c).finish(); });
}

void run_call_inline(CallJob& job) {
  CommBlock comm(job, 0);
  bool failed = false;
  // allgather_gemm's GEMM needs the copies: they run between its tiles whatever `overlap` says.
  const bool poll = job.overlap || job.op == kOpAllgatherGemm;
  run_compute_blocks(job, [&] {
    bool any = false;
    if (!failed && poll) guarded(job, [&] { any = comm.poll(); });
    failed = job.abort.load(std::memory_order_acquire);
    return any;
  });
  job.compute_done.store(true, std::memory_order_release);
  if (!job.abort.load(std::memory_order_acquire)) guarded(job, [&] { comm.finish(); });
}

}  // namespace gemm_ar::cpu
