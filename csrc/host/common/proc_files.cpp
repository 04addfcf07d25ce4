#include "common/proc_files.h"

#include <limits.h>
#include <unistd.h>

#include <fstream>

namespace gemm_ar {

std::string first_line_of(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string symlink_target(const char* path) {
  char buffer[PATH_MAX];
  const ssize_t n = readlink(path, buffer, sizeof(buffer) - 1);
  return n > 0 ? std::string(buffer, n) : std::string("?");
}

}  // namespace gemm_ar
