#include "cpu/fused_call.h"

#include <ATen/Parallel.h>
#include <gemm_ar/protocol.hpp>

#include <algorithm>
#include <sstream>
#include <stdexcept>

#include "cpu/call_header.h"
#include "cpu/tile_kernels.h"

namespace gemm_ar::cpu {

EngineSwitches& engine_switches() {
  static EngineSwitches switches;
  return switches;
}

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kSpins = 2000;                     // ~50-100 us of pause before sleeping
constexpr int64_t kSleepSliceNs = 2'000'000;     // a sleeper re-checks at least this often
constexpr auto kWatchEvery = std::chrono::milliseconds(50);

// Another block of this rank already failed the call and recorded why.
struct LocalAbort : std::exception {};
// The ranks disagreed or one rejected its arguments: found before any data moved.
struct CallRejected : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Waits until ready(), running progress() meanwhile (it returns whether it did anything), sleeping on `bell`
// after a short spin. Every `kWatchEvery` it runs watch() (which throws when a peer died or gave up); after
// `timeout` without success it throws describe().
template <class Ready, class Progress, class Watch, class Describe>
void bounded_wait(Ready ready, Progress progress, Watch watch, Describe describe, Doorbell bell,
                  std::chrono::milliseconds timeout, const std::atomic<bool>* stop) {
  if (ready()) return;
  const auto start = Clock::now();
  auto last_watch = start;
  int spins = 0;
  for (;;) {
    if (progress()) {
      spins = 0;
      if (ready()) return;
      continue;
    }
    if (stop != nullptr && stop->load(std::memory_order_acquire)) throw LocalAbort{};
    const uint32_t seen = bell.snapshot();
    if (ready()) return;
    if (spins < kSpins) {
      ++spins;
      cpu_relax();
      continue;
    }
    bell.sleep(seen, kSleepSliceNs);
    if (ready()) return;
    const auto now = Clock::now();
    if (now - last_watch >= kWatchEvery) {
      watch();
      last_watch = now;
    }
    if (now - start > timeout) throw std::runtime_error(describe());
  }
}

bool no_progress() { return false; }

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream os;
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  return os.str();
}

uint32_t* word(uint8_t* p) { return reinterpret_cast<uint32_t*>(p); }

void ring_all(const CallJob& job, int r) {
  for (int64_t c = 0; c < job.comm_blocks; ++c) doorbell(job.windows[r], c).ring();
  doorbell(job.windows[r], kMainDoorbell).ring();
}

}  // namespace

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
    for (int r = 0; r < world; ++r) ring_all(*this, r);
  } else {
    ring_all(*this, rank);
  }
}

std::vector<CallSignature> gather_signatures(const std::vector<uint8_t*>& windows, const WindowSet& window_set,
                                             int rank, uint32_t epoch, const CallSignature& mine,
                                             std::chrono::milliseconds timeout, Doorbell bell,
                                             const std::atomic<bool>* stop) {
  const int world = static_cast<int>(windows.size());
  std::vector<CallSignature> all(world);
  std::vector<char> arrived(world, 0);
  all[rank] = mine;
  arrived[rank] = 1;
  auto ready = [&] {
    bool done = true;
    for (int r = 0; r < world; ++r) {
      if (arrived[r]) continue;
      switch (read_header(windows[r], epoch, &all[r])) {
        case PeerCallState::kArrived: arrived[r] = 1; break;
        case PeerCallState::kNotYet: done = false; break;
        case PeerCallState::kAbandoned:
          throw CallRejected("gemm_allreduce: rank " + std::to_string(r) + " abandoned call " +
                             std::to_string(epoch) + " before it started (see that rank's error) [rank " +
                             std::to_string(rank) + "]");
      }
    }
    return done;
  };
  const std::string context = "before call " + std::to_string(epoch);
  bounded_wait(
      ready, no_progress, [&] { window_set.check_peers_alive(context.c_str()); },
      [&] {
        std::vector<int> missing;
        for (int r = 0; r < world; ++r)
          if (!arrived[r]) missing.push_back(r);
        std::ostringstream os;
        os << "gemm_allreduce: rank(s) " << rank_list(missing) << " did not arrive at call " << epoch << " within "
           << timeout.count() / 1000.0 << " s (TORCH_GEMM_AR_TIMEOUT_S) [rank " << rank << "]";
        return os.str();
      },
      bell, timeout, stop);
  return all;
}

void plan_work(CallJob& job) {
  const TilePlan& p = job.plan;
  const int64_t stripes = p.stripes;
  std::vector<int64_t> block_begin(job.compute_blocks);
  for (int64_t b = 0; b < job.compute_blocks; ++b) block_begin[b] = block_range(p.tiles, job.compute_blocks, b).begin;
  job.items.assign(job.comm_blocks, {});
  for (int owner = 0; owner < job.world; ++owner) {
    const int64_t owned = owned_subtile_count(p.tiles, job.world, owner, stripes);
    for (int64_t l = 0; l < owned; ++l) {
      const int64_t t = subtile_tile(l, owner, job.world, stripes);
      const int64_t stripe = subtile_stripe(l, stripes);
      if (stripe_rows(p, tile_row(p, t), stripe) == 0) continue;  // all padding: nothing to move
      const int64_t linear = zigzag_linear(t, p.n_tiles);
      const int64_t block = std::upper_bound(block_begin.begin(), block_begin.end(), linear) - block_begin.begin() - 1;
      job.items[ag_block_of(l, job.comm_blocks)].push_back(WorkItem{owner, l, t, stripe, linear - block_begin[block]});
    }
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

void run_compute_blocks(CallJob& job) {
  const TilePlan& p = job.plan;
  const WindowLayout& w = job.layout;
  auto compute_block = [&](int64_t b) {
    const Range range = block_range(p.tiles, job.compute_blocks, b);
    uint32_t* count = word(job.region(job.rank, queue_count_offset(w, b)));
    const Doorbell bell = doorbell(job.windows[job.rank], queue_comm_block(b, job.comm_blocks));
    for (int64_t i = 0; i < range.end - range.begin; ++i) {
      if (job.abort.load(std::memory_order_acquire)) return;
      const int64_t t = zigzag_tile(range.begin + i, p.n_tiles);
      const int64_t mi = tile_row(p, t), ni = tile_col(p, t);
      const int64_t rows = tile_rows(p, mi), cols = tile_cols(p, ni);
      const int64_t row0 = mi * p.base_m, col0 = ni * p.base_n;
      auto view = at::from_blob(job.region(job.rank, partial_entry_offset(w, row0, col0, p.pad_n, job.partial_elem)),
                                {rows, cols}, {p.pad_n, 1}, at::TensorOptions().dtype(job.partial_dtype));
      job.gemm->compute(row0, rows, col0, cols, view);
      // Payload, then the entry, then the count with release order: the comm block sees a finished tile.
      *word(job.region(job.rank, queue_entry_offset(w, b, i))) = static_cast<uint32_t>(t);
      store_release(count, static_cast<uint32_t>(i + 1));
      bell.ring();
    }
  };
  at::parallel_for(0, job.compute_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) compute_block(b);
  });
}

namespace {

void comm_block_body(CallJob& job, int64_t c) {
  const TilePlan& p = job.plan;
  const WindowLayout& w = job.layout;
  const int me = job.rank, world = job.world;
  const uint32_t epoch = job.epoch;
  const Doorbell bell = doorbell(job.windows[me], c);
  const std::string call_name = "call " + std::to_string(epoch);

  // 1. Agree on the call before touching any peer's data.
  if (c == 0) {
    auto all = gather_signatures(job.windows, *job.window_set, me, epoch, job.signature, job.timeout, bell, &job.abort);
    std::string problem = diagnose_signatures(all, me, *job.call, job.group_name);
    if (!problem.empty()) throw CallRejected(problem);
    job.headers_checked.store(1, std::memory_order_release);
    for (int64_t other = 1; other < job.comm_blocks; ++other) doorbell(job.windows[me], other).ring();
  } else {
    bounded_wait([&] { return job.headers_checked.load(std::memory_order_acquire) == 1; }, no_progress, [] {},
                 [&] { return "gemm_allreduce: internal: call header check did not finish"; }, bell,
                 job.timeout * 2, &job.abort);
  }
  auto watch = [&] {
    job.window_set->check_peers_alive(("during " + call_name).c_str());
    for (int r = 0; r < world; ++r) {
      if (r != me && abandoned(job.windows[r], epoch)) {
        throw std::runtime_error("gemm_allreduce: rank " + std::to_string(r) + " abandoned " + call_name +
                                 " (see that rank's error) [rank " + std::to_string(me) + "]");
      }
    }
  };
  if (!job.overlap) {  // the seed's "sequential": communication only after the whole GEMM
    bounded_wait([&] { return job.compute_done.load(std::memory_order_acquire); }, no_progress, watch,
                 [&] { return "gemm_allreduce: the GEMM did not finish in time"; }, bell, job.timeout, &job.abort);
  }

  // 2. Drain this block's ready queues: each finished local tile is published to its owner.
  struct Queue {
    uint32_t* count;
    int64_t block, consumed, expected;
  };
  std::vector<Queue> queues;
  for (int64_t j = 0; j < comm_block_queue_count(c, job.compute_blocks, job.comm_blocks); ++j) {
    const int64_t b = comm_block_queue(c, j, job.comm_blocks);
    const Range range = block_range(p.tiles, job.compute_blocks, b);
    queues.push_back(Queue{word(job.region(me, queue_count_offset(w, b))), b, 0, range.end - range.begin});
  }
  auto publish_tile = [&](int64_t t) {
    store_release(word(job.region(me, tile_flag_entry_offset(w, t))), epoch);
    const int owner = static_cast<int>(owner_of(t, world));
    uint64_t rung = 0;
    for (int64_t s = 0; s < p.stripes; ++s) {
      const int64_t block = ag_block_of(local_subtile(t, s, world, p.stripes), job.comm_blocks);
      if (rung & (uint64_t{1} << block)) continue;
      rung |= uint64_t{1} << block;
      doorbell(job.windows[owner], block).ring();
    }
  };
  auto drain = [&] {
    bool any = false;
    for (auto& q : queues) {
      const uint32_t available = load_acquire(q.count);
      for (; q.consumed < available; ++q.consumed) {
        publish_tile(*word(job.region(me, queue_entry_offset(w, q.block, q.consumed))));
        any = true;
      }
    }
    return any;
  };
  auto is_current = [&](uint32_t flag) { return job.ignore_epochs ? flag != 0 : flag == epoch; };

  // 3. Reduce this rank's subtiles, copy everyone else's, in production order.
  std::vector<const uint8_t*> sources(world);
  for (const WorkItem& item : job.items[c]) {
    const int64_t mi = tile_row(p, item.tile), ni = tile_col(p, item.tile);
    const int64_t row0 = mi * p.base_m + item.stripe * p.sub_m, col0 = ni * p.base_n;
    const int64_t rows = stripe_rows(p, mi, item.stripe), cols = tile_cols(p, ni);
    uint8_t* out = job.out + (row0 * p.n + col0) * job.out_elem;
    const int64_t bank_offset = reduced_entry_offset(w, job.bank, row0, col0, p.pad_n, job.out_elem);
    if (item.owner == me) {
      auto ready = [&] {
        for (int r = 0; r < world; ++r)
          if (!is_current(load_acquire(word(job.region(r, tile_flag_entry_offset(w, item.tile)))))) return false;
        return true;
      };
      auto missing = [&] {
        std::vector<int> late;
        for (int r = 0; r < world; ++r)
          if (!is_current(load_acquire(word(job.region(r, tile_flag_entry_offset(w, item.tile)))))) late.push_back(r);
        return "gemm_allreduce: rank(s) " + rank_list(late) + " did not deliver tile " + std::to_string(item.tile) +
               " of " + call_name + " within " + std::to_string(job.timeout.count() / 1000.0) +
               " s (TORCH_GEMM_AR_TIMEOUT_S) [rank " + std::to_string(me) + "]";
      };
      bounded_wait(ready, drain, watch, missing, bell, job.timeout, &job.abort);
      for (int r = 0; r < world; ++r)
        sources[r] = job.region(r, partial_entry_offset(w, row0, col0, p.pad_n, job.partial_elem));
      reduce_rows(ReduceRows{sources.data(), world, p.pad_n, job.partial_dtype, job.region(me, bank_offset), p.pad_n,
                             out, p.n, job.out_dtype, rows, cols});
      store_release(word(job.region(me, final_entry_offset(w, item.local_id))), epoch);
      for (int64_t i = 0; i + 1 < world; ++i) {
        doorbell(job.windows[rotated_peer(me, item.local_id, i, world)], c).ring();
      }
    } else {
      uint32_t* final_flag = word(job.region(item.owner, final_entry_offset(w, item.local_id)));
      bounded_wait(
          [&] { return is_current(load_acquire(final_flag)); }, drain, watch,
          [&] {
            return "gemm_allreduce: rank " + std::to_string(item.owner) + " did not finish its subtile " +
                   std::to_string(item.local_id) + " of " + call_name + " within " +
                   std::to_string(job.timeout.count() / 1000.0) + " s (TORCH_GEMM_AR_TIMEOUT_S) [rank " +
                   std::to_string(me) + "]";
          },
          bell, job.timeout, &job.abort);
      copy_rows(job.region(item.owner, bank_offset), p.pad_n * job.out_elem, out, p.n * job.out_elem, rows,
                cols * job.out_elem);
    }
  }

  // 4. Every local tile must reach its owner, even when this block has nothing left to gather.
  bounded_wait(
      [&] {
        for (const auto& q : queues)
          if (q.consumed < q.expected) return false;
        return true;
      },
      drain, watch, [&] { return "gemm_allreduce: the local GEMM did not finish " + call_name + " in time"; }, bell,
      job.timeout, &job.abort);
}

}  // namespace

void run_comm_block(CallJob& job, int64_t c) {
  try {
    comm_block_body(job, c);
  } catch (const LocalAbort&) {
    // Another block of this rank failed first and recorded the reason.
  } catch (const CallRejected& e) {
    job.fail(e.what(), /*disagreement=*/true);
  } catch (const std::exception& e) {
    job.fail(e.what(), /*disagreement=*/false);
  }
}

}  // namespace gemm_ar::cpu
