#include "cpu/store_exchange.h"

#include <c10/util/Exception.h>

#include <sstream>
#include <thread>

#include "common/current_op.h"

namespace gemm_ar::cpu {

std::vector<std::string> exchange_over_store(c10d::Store& store, const std::string& prefix, int rank, int world,
                                             const std::string& value, std::chrono::milliseconds timeout,
                                             const std::function<void()>& poll) {
  auto key = [&](int r) { return prefix + "/" + std::to_string(r); };
  store.set(key(rank), std::vector<uint8_t>(value.begin(), value.end()));
  std::vector<std::string> keys;
  for (int r = 0; r < world; ++r) keys.push_back(key(r));
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(200);
  while (!store.check(keys)) {
    if (poll) poll();
    if (std::chrono::steady_clock::now() > deadline) {
      std::ostringstream missing;
      for (int r = 0; r < world; ++r) {
        if (!store.check({key(r)})) missing << (missing.tellp() ? ", " : "") << r;
      }
      TORCH_CHECK(false, current_op(), ": rank(s) ", missing.str(), " did not arrive at '", prefix, "' within ",
                  timeout.count() / 1000.0, " s (TORCH_GEMM_AR_TIMEOUT_S) [rank ", rank, "]");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
  std::vector<std::string> values;
  for (int r = 0; r < world; ++r) {
    auto bytes = store.get(key(r));
    values.emplace_back(bytes.begin(), bytes.end());
  }
  return values;
}

}  // namespace gemm_ar::cpu
