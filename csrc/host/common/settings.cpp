#include "common/settings.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>
#include <string>

namespace gemm_ar {

int64_t env_int(const char* name, int64_t fallback, int64_t min_value, int64_t max_value) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  long long value = std::strtoll(text, &end, 10);
  TORCH_CHECK(errno == 0 && end != text && *end == '\0' && value >= min_value && value <= max_value,
              "environment variable ", name, "='", text, "' must be an integer in [", min_value, ", ",
              max_value, "]");
  return value;
}

double env_double(const char* name, double fallback, double min_value, double max_value) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  double value = std::strtod(text, &end);
  TORCH_CHECK(errno == 0 && end != text && *end == '\0' && value >= min_value && value <= max_value,
              "environment variable ", name, "='", text, "' must be a number in [", min_value, ", ",
              max_value, "]");
  return value;
}

std::chrono::milliseconds wait_timeout() {
  double seconds = env_double("TORCH_GEMM_AR_TIMEOUT_S", 300.0, 0.01, 86400.0);
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

int64_t chunk_count() { return env_int("TORCH_GEMM_AR_CHUNKS", 4, 1, 4096); }

}  // namespace gemm_ar
