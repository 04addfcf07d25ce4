#include "cpu/call_waits.h"

#include <sstream>

#include "common/current_op.h"
#include "cpu/call_header.h"

namespace gemm_ar::cpu {

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream os;
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  return os.str();
}

// Throws when a peer died or abandoned the call (checked while waiting).
void watch_peers(const CallJob& job, const std::string& call_name) {
  job.window_set->check_peers_alive(("during " + call_name).c_str());
  for (int r = 0; r < job.world; ++r) {
    if (r != job.rank && abandoned(job.windows[r], job.epoch)) {
      // A peer abandons the call when it finds a rank dead: name the dead rank here too, not only the messenger.
      job.window_set->check_peers_alive(("during " + call_name).c_str());
      throw std::runtime_error(current_op() + ": rank " + std::to_string(r) + " abandoned " + call_name +
                               " (see that rank's error) [rank " + std::to_string(job.rank) + "]");
    }
  }
}

std::string wait_bound(const CallJob& job) {
  return " within " + std::to_string(job.timeout.count() / 1000.0) + " s (TORCH_GEMM_AR_TIMEOUT_S) [rank " +
         std::to_string(job.rank) + "]";
}

std::string undelivered_tile(const CallJob& job, int64_t t) {
  return late_ranks(job.world, -1, [&](int r) { return !tile_ready(job, r, t); }) + " did not deliver tile " +
         std::to_string(t) + " of call " + std::to_string(job.epoch) + wait_bound(job);
}

}  // namespace gemm_ar::cpu
