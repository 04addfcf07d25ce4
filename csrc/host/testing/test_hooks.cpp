// The test build's hook values (common/test_hooks.h); this file is compiled only into the test build.
#include "common/test_hooks.h"

#ifndef TORCH_GEMM_AR_TEST_HOOKS
#error "csrc/host/testing is compiled only into the test build (TORCH_GEMM_AR_TEST_HOOKS)"
#endif

namespace gemm_ar::test_hooks {

Hooks& hooks() {
  static Hooks values;
  return values;
}

}  // namespace gemm_ar::test_hooks
