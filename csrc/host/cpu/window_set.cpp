#include "cpu/window_set.h"

#include <c10/util/Exception.h>
#include <signal.h>

#include <cerrno>

#include "common/current_op.h"
#include "cpu/store_exchange.h"

namespace gemm_ar::cpu {

WindowSet::WindowSet(c10::intrusive_ptr<c10d::Store> store, int rank, int world, std::vector<pid_t> pids)
    : store_(std::move(store)), rank_(rank), world_(world), pids_(std::move(pids)) {}

void WindowSet::check_peers_alive(const char* context) const {
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    if (kill(pids_[r], 0) != 0 && errno == ESRCH) {
      TORCH_CHECK(false, current_op(), ": rank ", r, " (pid ", pids_[r], ") died ", context, " [rank ", rank_, "]");
    }
  }
}

void WindowSet::resize(size_t bytes, uint64_t round, std::chrono::milliseconds timeout,
                       const std::function<void()>& poll) {
  const std::string prefix = "gemm_ar/windows/" + std::to_string(round);
  SharedSegment mine = SharedSegment::create(bytes, std::to_string(getpid()) + "-r" + std::to_string(rank_));
  std::vector<std::string> names;
  auto forget_all = [&] {
    SharedSegment::unlink_name(mine.name());
    for (const auto& name : names) SharedSegment::unlink_name(name);
  };
  try {
    names = exchange_over_store(*store_, prefix + "/name", rank_, world_, mine.name() + "|" + std::to_string(bytes),
                                timeout, poll);
    std::vector<std::shared_ptr<SharedSegment>> next(world_);
    for (int r = 0; r < world_; ++r) {
      const auto bar = names[r].rfind('|');
      const std::string name = names[r].substr(0, bar);
      TORCH_CHECK(std::stoull(names[r].substr(bar + 1)) == bytes, current_op(), ": rank ", r,
                  " sized its window differently (", names[r].substr(bar + 1), " vs ", bytes, " bytes)");
      names[r] = name;
      next[r] = std::make_shared<SharedSegment>(r == rank_ ? std::move(mine) : SharedSegment::open(name, bytes));
    }
    // Once every rank has mapped every window, the names are no longer needed: unlink ours right away so that
    // nothing is left in /dev/shm, even if a process is killed later.
    exchange_over_store(*store_, prefix + "/mapped", rank_, world_, "1", timeout, poll);
    SharedSegment::unlink_name(next[rank_]->name());
    windows_ = std::move(next);
  } catch (...) {
    forget_all();
    throw;
  }
}

}  // namespace gemm_ar::cpu
