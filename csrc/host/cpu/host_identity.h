// What makes two processes "on one host" for the shared-memory engine: same kernel boot, same /dev/shm (mount
// namespace) and same pid numbering (pid namespace, for liveness checks).
#pragma once
#include <string>

namespace gemm_ar::cpu {

std::string host_identity();

}  // namespace gemm_ar::cpu
