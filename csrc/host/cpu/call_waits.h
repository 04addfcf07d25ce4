// The bounded waits of one fused call (cpu/fused_call.h) and the checks they make between tries: shared by the comm
// blocks and by the compute blocks that wait for peers (allgather_gemm's rows, gemm_reduce_scatter's owner-last
// reduction). Every wait ends: in success, an exception naming the late or dead rank, or LocalAbort.
#pragma once
#include <gemm_ar/layout.hpp>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/current_op.h"
#include "cpu/fused_call.h"

namespace gemm_ar::cpu {

// Another block of this rank already failed the call and recorded why.
struct LocalAbort : std::exception {};
// The ranks disagreed or one rejected its arguments: found before any data moved.
struct CallRejected : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr int64_t kWaitSleepSliceNs = 2'000'000;  // a sleeper re-checks at least this often
constexpr auto kWatchEvery = std::chrono::milliseconds(50);
// A spinning waiter gives its core away this often: when ranks share cores with each other or with other jobs, the
// peer it waits for may be the thread it would otherwise keep off the core (docs/decisions/0006).
constexpr int kSpinsPerYield = 256;

// Waits until ready(), running progress() meanwhile (it returns whether it did anything), sleeping on `bell`
// after a short spin (`max_spins` pauses). Every `kWatchEvery` it runs watch() (which throws when a peer died or gave
// up); after `timeout` without success it throws describe().
template <class Ready, class Progress, class Watch, class Describe>
void bounded_wait(Ready ready, Progress progress, Watch watch, Describe describe, Doorbell bell,
                  std::chrono::milliseconds timeout, const std::atomic<bool>* stop, int max_spins = kWaitSpins) {
  using Clock = std::chrono::steady_clock;
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
    if (spins < max_spins) {
      ++spins;
      if (spins % kSpinsPerYield != 0) {
        cpu_relax();
        continue;
      }
      // A long spin (a decode call's or a tuning call's) yields, and watches its peers and its bound, as sleeps do.
      sched_yield();
    } else {
      bell.sleep(seen, kWaitSleepSliceNs);
    }
    if (ready()) return;
    const auto now = Clock::now();
    if (now - last_watch >= kWatchEvery) {
      watch();
      last_watch = now;
    }
    if (now - start > timeout) throw std::runtime_error(describe());
  }
}

inline bool no_progress() { return false; }

inline uint32_t* window_word(uint8_t* p) { return reinterpret_cast<uint32_t*>(p); }

// "0, 2, 3"
std::string rank_list(const std::vector<int>& ranks);

// "<op>: rank(s) 1, 3": how a timed-out wait's message begins, naming the ranks r (other than `except`;
// -1: none) for which late(r) still holds.
template <class Late>
std::string late_ranks(int world, int except, Late late) {
  std::vector<int> ranks;
  for (int r = 0; r < world; ++r)
    if (r != except && late(r)) ranks.push_back(r);
  return current_op() + ": rank(s) " + rank_list(ranks);
}

// Throws when a peer died or abandoned the call (checked while waiting).
void watch_peers(const CallJob& job, const std::string& call_name);

// Whether `flag` (a tile, final or row flag read with acquire order) belongs to this call.
inline bool is_current(const CallJob& job, uint32_t flag) { return job.ignore_epochs ? flag != 0 : flag == job.epoch; }

// Whether rank r published its partial product of tile t in this call (acquire: its payload is visible then).
inline bool tile_ready(const CallJob& job, int r, int64_t t) {
  return is_current(job, load_acquire(window_word(job.region(r, tile_flag_entry_offset(job.layout, t)))));
}

// "<op>: rank(s) 1, 3 did not deliver tile 7 of call 12 within ...": the ranks whose partial of tile t
// (owned by this rank) has not arrived.
std::string undelivered_tile(const CallJob& job, int64_t t);

// " within 20.0 s (TORCH_GEMM_AR_TIMEOUT_S) [rank 1]": the end of every timeout message.
std::string wait_bound(const CallJob& job);

}  // namespace gemm_ar::cpu
