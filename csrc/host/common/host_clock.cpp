#include "common/host_clock.h"

#include <time.h>

#include <functional>
#include <string>

#include "common/proc_files.h"

namespace gemm_ar {

int64_t monotonic_us() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

int64_t monotonic_clock_domain() {
  // A time namespace may offset CLOCK_MONOTONIC, so the boot alone does not name the time line.
  static const int64_t domain = [] {
    const std::string id =
        first_line_of("/proc/sys/kernel/random/boot_id") + "/" + symlink_target("/proc/self/ns/time");
    return static_cast<int64_t>(std::hash<std::string>{}(id) >> 2) + 1;  // positive, never 0 ("no clock")
  }();
  return domain;
}

}  // namespace gemm_ar
