// Small readers of /proc entries that identify a host, a boot or a namespace.
#pragma once
#include <string>

namespace gemm_ar {

std::string first_line_of(const char* path);   // "" when unreadable
std::string symlink_target(const char* path);  // "?" when unreadable (e.g. /proc/self/ns/* without that namespace)

}  // namespace gemm_ar
