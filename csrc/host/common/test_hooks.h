// Deliberate faults for the negative-control tests, one list. They exist only in the test build (compiled with
// TORCH_GEMM_AR_TEST_HOOKS by tests/hooked_build.py, as the kernels' controls exist only in simulator builds): in the
// product every hook is a constexpr function returning its harmless value, so the branches that read it fold away
// and nothing test-only reaches the call signature or the Python module (docs/decisions/0015-test-hooks.md).
#pragma once
#include <cstdint>
#ifdef TORCH_GEMM_AR_TEST_HOOKS
#include <atomic>
#endif

// X(type, name, harmless value, what the fault does)
#define GEMM_AR_TEST_HOOK_LIST(X)                                                                                    \
  X(bool, ignore_epochs, false, "CPU engine: flags of earlier calls count as ready")                                 \
  X(bool, process_wide_setup_lock, false,                                                                            \
    "CPU engine: one process-wide lock held while a group's setup waits for its peers (two threads can deadlock)")   \
  X(bool, overwrite_residual, false, "in-place add+RMSNorm: the residual is overwritten with the sum, not added to") \
  X(bool, gathered_inputs_late, false, "gathered-inputs flow: inputs published after the flags announcing them")     \
  X(bool, one_shot_single_bank, false, "one-shot calls put their partials in bank 0 whatever the call's parity")     \
  X(bool, skip_previous_call_wait, false,                                                                            \
    "calls publish headers and write into windows without checking that every peer started the previous call")       \
  X(bool, shared_output_no_wait, false,                                                                              \
    "an owner whose output is in a window slot returns before its peers have copied its rows")                       \
  X(int64_t, peer_copy_delay_us, 0, "a rank sleeps this long before each copy of a peer's rows (timing only)")       \
  X(int64_t, deferred_tuner_clock, 0,                                                                                \
    "1: auto's tuning calls timed as on the NPU (a clock read at the bucket's next call); 2: reading it fails")      \
  X(int64_t, tuner_start_delay_us, 0, "this rank starts every tuning run this late")                                 \
  X(bool, tuner_own_time, false, "tuning runs counted by the slowest rank's own time (the old measure)")             \
  X(int64_t, tuner_slow_candidate, -1,                                                                               \
    "tuning runs of this candidate take tuner_slow_us longer (-1 none; see AutoTuner::kEveryCandidate, kAllBut)")    \
  X(int64_t, tuner_slow_us, 0, "how much longer the runs of tuner_slow_candidate take")

namespace gemm_ar::test_hooks {

// Whether this library is the test build.
constexpr bool kEnabled =
#ifdef TORCH_GEMM_AR_TEST_HOOKS
    true;
#else
    false;
#endif

#ifdef TORCH_GEMM_AR_TEST_HOOKS
// Set by the tests between calls and read by the calls: relaxed, the rank processes order them by their own calls.
struct Hooks {
#define GEMM_AR_TEST_HOOK_FIELD(type, name, harmless, what) std::atomic<type> name{harmless};
  GEMM_AR_TEST_HOOK_LIST(GEMM_AR_TEST_HOOK_FIELD)
#undef GEMM_AR_TEST_HOOK_FIELD
};
Hooks& hooks();
#define GEMM_AR_TEST_HOOK_GETTER(type, name, harmless, what) \
  inline type name() { return hooks().name.load(std::memory_order_relaxed); }
#else
#define GEMM_AR_TEST_HOOK_GETTER(type, name, harmless, what) \
  constexpr type name() { return harmless; }
#endif
GEMM_AR_TEST_HOOK_LIST(GEMM_AR_TEST_HOOK_GETTER)
#undef GEMM_AR_TEST_HOOK_GETTER

}  // namespace gemm_ar::test_hooks
