#include "cpu/host_identity.h"

#include <limits.h>
#include <unistd.h>

#include "common/proc_files.h"

namespace gemm_ar::cpu {

std::string host_identity() {
  char name[HOST_NAME_MAX + 1] = {0};
  gethostname(name, sizeof(name) - 1);
  return std::string(name) + "/" + first_line_of("/proc/sys/kernel/random/boot_id") + "/" +
         symlink_target("/proc/self/ns/mnt") + "/" + symlink_target("/proc/self/ns/pid");
}

}  // namespace gemm_ar::cpu
