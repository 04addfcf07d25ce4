#include "emu_settings.h"

#include <cerrno>
#include <cstdlib>
#include <stdexcept>

namespace gemm_ar::emu::settings {

int64_t integer(const char* name, int64_t fallback, int64_t minimum) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text, &end, 10);
  if (errno != 0 || *end != '\0' || value < minimum) {
    throw std::invalid_argument(std::string("emulated NPU: ") + name + "=" + text +
                                " is not a whole number >= " + std::to_string(minimum));
  }
  return value;
}

std::string word(const char* name, const char* fallback, std::initializer_list<const char*> allowed) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  std::string choices;
  for (const char* option : allowed) {
    if (std::string(text) == option) return text;
    choices += choices.empty() ? option : std::string(", ") + option;
  }
  throw std::invalid_argument(std::string("emulated NPU: ") + name + "=" + text + " is not one of " + choices);
}

void check_all() {
  wait_seconds();
  cube_cores();
  vector_cores();
  aicore_timeout_ms();
  window_megabytes();
  zero_windows();
  fault_window_shift();
}

}  // namespace gemm_ar::emu::settings
