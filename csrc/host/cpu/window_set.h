// The symmetric windows of one process group on one host: one shared-memory segment per rank, mapped by every rank at
// the same offsets (docs/decisions/0006-cpu-engine-shared-memory-windows.md). Set up and grown collectively through the
// group's store.
#pragma once
#include <sys/types.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cpu/shm_segment.h"

namespace gemm_ar::cpu {

class WindowSet {
 public:
  WindowSet(c10::intrusive_ptr<c10d::Store> store, int rank, int world, std::vector<pid_t> pids);

  // Collective: afterwards every rank has mapped a zero-filled window of `bytes` (the same on every rank) from
  // every rank, and no name is left in /dev/shm. `poll` runs while waiting for peers (it throws to give up early).
  // On failure the names this rank knows are unlinked and the previous windows stay in place.
  // `round` names this rendezvous in the store and must be the same on every rank and never reused (the call
  // number): a rendezvous that failed on some ranks leaves keys that a later one must not read.
  void resize(size_t bytes, uint64_t round, std::chrono::milliseconds timeout, const std::function<void()>& poll);

  uint8_t* base(int rank) const { return static_cast<uint8_t*>(windows_[rank]->data()); }
  size_t bytes() const { return windows_.empty() ? 0 : windows_[0]->size(); }
  // Keeps rank's current mapping alive after a resize (tensors that live in a window: cpu/shared_outputs.h).
  std::shared_ptr<const SharedSegment> segment(int rank) const { return windows_[rank]; }
  bool mapped() const { return !windows_.empty(); }
  pid_t pid(int rank) const { return pids_[rank]; }
  // Throws naming the first peer whose process no longer exists.
  void check_peers_alive(const char* context) const;

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_, world_;
  std::vector<pid_t> pids_;
  std::vector<std::shared_ptr<SharedSegment>> windows_;
};

}  // namespace gemm_ar::cpu
