#include "common/settings.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>
#include <string>

namespace gemm_ar {
namespace {

constexpr SettingInfo kSettings[] = {
#define GEMM_AR_SETTING_INFO(id, variable, initial, when, what) {variable, initial, when, what},
    GEMM_AR_SETTING_LIST(GEMM_AR_SETTING_INFO)
#undef GEMM_AR_SETTING_INFO
};

}  // namespace

const SettingInfo& setting_info(Setting setting) { return kSettings[static_cast<int>(setting)]; }
int setting_count() { return static_cast<int>(sizeof(kSettings) / sizeof(kSettings[0])); }
const SettingInfo& setting_info_at(int index) { return kSettings[index]; }

const char* env_text(Setting setting) {
  const char* text = std::getenv(setting_info(setting).variable);
  return text != nullptr && *text != '\0' ? text : nullptr;
}

int64_t env_int(Setting setting, int64_t fallback, int64_t min_value, int64_t max_value) {
  const char* text = env_text(setting);
  if (text == nullptr) return fallback;
  char* end = nullptr;
  errno = 0;
  long long value = std::strtoll(text, &end, 10);
  TORCH_CHECK(errno == 0 && end != text && *end == '\0' && value >= min_value && value <= max_value,
              "environment variable ", setting_info(setting).variable, "='", text, "' must be an integer in [",
              min_value, ", ", max_value, "]");
  return value;
}

double env_double(Setting setting, double fallback, double min_value, double max_value) {
  const char* text = env_text(setting);
  if (text == nullptr) return fallback;
  char* end = nullptr;
  errno = 0;
  double value = std::strtod(text, &end);
  TORCH_CHECK(errno == 0 && end != text && *end == '\0' && value >= min_value && value <= max_value,
              "environment variable ", setting_info(setting).variable, "='", text, "' must be a number in [", min_value,
              ", ", max_value, "]");
  return value;
}

std::chrono::milliseconds wait_timeout() {
  double seconds = env_double(Setting::kTimeoutS, 300.0, 0.01, 86400.0);
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

int64_t chunk_count() { return env_int(Setting::kChunks, 4, 1, 4096); }

}  // namespace gemm_ar
