#include "cpu/host_identity.h"

#include <unistd.h>

#include <fstream>
#include <limits.h>

namespace gemm_ar::cpu {
namespace {

std::string first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string link_target(const char* path) {
  char buffer[PATH_MAX];
  const ssize_t n = readlink(path, buffer, sizeof(buffer) - 1);
  return n > 0 ? std::string(buffer, n) : std::string("?");
}

}  // namespace

std::string host_identity() {
  char name[HOST_NAME_MAX + 1] = {0};
  gethostname(name, sizeof(name) - 1);
  return std::string(name) + "/" + first_line("/proc/sys/kernel/random/boot_id") + "/" +
         link_target("/proc/self/ns/mnt") + "/" + link_target("/proc/self/ns/pid");
}

}  // namespace gemm_ar::cpu
