// The op a thread is running a call of, so that an error raised deep in an engine (shared-memory setup, a wait on a
// peer, a comm block) names the op that failed. Set by the op flows for the caller's thread and by the CPU engine's
// comm threads for the call they serve; "torch_gemm_ar" outside any call.
#pragma once
#include <string>

namespace gemm_ar {

const std::string& current_op();

// Names the thread's op for the guard's lifetime (nests: the previous name comes back).
class CurrentOp {
 public:
  explicit CurrentOp(const std::string& op_name);
  ~CurrentOp();
  CurrentOp(const CurrentOp&) = delete;
  CurrentOp& operator=(const CurrentOp&) = delete;

 private:
  const std::string* previous_;
};

}  // namespace gemm_ar
