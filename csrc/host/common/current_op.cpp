#include "common/current_op.h"

namespace gemm_ar {
namespace {

const std::string kNoOp = "torch_gemm_ar";
thread_local const std::string* running = &kNoOp;

}  // namespace

const std::string& current_op() { return *running; }

CurrentOp::CurrentOp(const std::string& op_name) : previous_(running) { running = &op_name; }

CurrentOp::~CurrentOp() { running = previous_; }

}  // namespace gemm_ar
