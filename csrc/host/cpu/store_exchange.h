// All-gather of one short string per rank through the process group's store, bounded by a deadline. Used only at
// set-up and window growth (never per call), so its latency does not matter; its bound does.
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace gemm_ar::cpu {

// Publishes `value` under `prefix`/<rank> and returns every rank's value. While waiting it calls `poll` (which may
// throw, e.g. when a peer is known to have died) and throws after `timeout`, naming the ranks that never published.
std::vector<std::string> exchange_over_store(c10d::Store& store, const std::string& prefix, int rank, int world,
                                             const std::string& value, std::chrono::milliseconds timeout,
                                             const std::function<void()>& poll);

}  // namespace gemm_ar::cpu
