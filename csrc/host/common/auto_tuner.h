// `algorithm="auto"` by measurement (docs/usage.md, "`auto` by measurement"): the first calls of a group on a shape
// bucket race the candidate algorithms, round-robin: each runs a few times, clear losers leave, close ones run more
// (within a time budget). Every rank times its own calls and tells the others through the call signature of the next
// call (carried fields, never an extra collective), so every rank decides alike. A run counts from the moment its last
// rank started it to the moment its last rank finished, when the ranks share a host's monotonic clock (an early rank's
// wait for a late one is not the algorithm's cost: fused calls right after a collective looked twice as slow as they
// run; docs/decisions/0002-algorithms-and-measured-auto.md); otherwise, e.g. on a device clock, the slowest rank's own
// time counts. Decisions are kept per group in memory and per host fingerprint in a JSON file
// (TORCH_GEMM_AR_TUNE_CACHE); a cached decision is used only when every rank has the same one. TORCH_GEMM_AR_AUTOTUNE=0
// keeps the static policy.
#pragma once
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <functional>
#include <string>
#include <vector>

#include "common/algorithm.h"
#include "common/call_args.h"
#include "common/rank_agreement.h"

namespace gemm_ar {

struct TunerDecision {
  std::string group, bucket, algorithm, source;                 // source: measured | cache
  std::vector<std::pair<std::string, double>> candidate_us;     // per candidate: the median of its runs
  std::vector<std::pair<std::string, int64_t>> candidate_runs;  // per candidate: how many runs it had
  // per candidate: the median of its runs over the fastest run of their rounds (the winner has the lowest)
  std::vector<std::pair<std::string, double>> candidate_relative;
};

class AutoTuner {
 public:
  static AutoTuner& instance();
  static bool enabled();  // TORCH_GEMM_AR_AUTOTUNE (default 1)

  // Asked before the agreement of an auto call: the decided algorithm, or Auto while the bucket is still being
  // met or tuned (then the call's tune_* fields are set, and after_agreement chooses from every rank's signature).
  // may_tune=false (a graph being captured): only a decision already made in this process, else static_choice.
  // `fused_variants` (BackendHooks::fused_variants) join the candidates of a bucket met for the first time (asked
  // only then).
  Algorithm before_agreement(CallArgs& call, c10d::ProcessGroup& group, bool fused_available, Algorithm static_choice,
                             bool may_tune = true, const std::function<std::vector<Algorithm>()>& fused_variants = {});
  // After a successful agreement of a tuning call: records the peers' times of the previous step, and returns
  // what this call runs (the next candidate, or the decision once every sample is in).
  Algorithm after_agreement(const CallArgs& call, c10d::ProcessGroup& group, const std::vector<CallSignature>& all);
  // This rank's start and end of the tuning call that just ran, on this host's monotonic clock (microseconds).
  void record(const CallArgs& call, c10d::ProcessGroup& group, int64_t start_us, int64_t end_us);
  // The same, known later (a device clock): `seconds` is asked, outside the tuner's lock, at the bucket's next call.
  void record_pending(const CallArgs& call, c10d::ProcessGroup& group, std::function<double()> seconds);
  // Forgets the tuning state of the call's bucket (the ranks disagreed about it: start again, together).
  void reset(const CallArgs& call, c10d::ProcessGroup& group);

  std::vector<TunerDecision> decisions() const;
  // What `auto` runs for a gemm_allreduce call (op 0, bias or not, on `device`) of M x K x N of `dtype` on
  // `group_name` of `world` ranks, once this process has decided its bucket (measured or from the tune cache); ""
  // while it is undecided or never met.
  std::string decision_for(const std::string& group_name, int64_t world, int64_t m, int64_t k, int64_t n,
                           at::ScalarType dtype, bool bias, c10::DeviceType device) const;
  // Whether a bucket of `group_name` ("": of any group) has had tuning calls and is not decided yet.
  bool in_progress(const std::string& group_name) const;
  void set_logger(std::function<void(const std::string&)> logger);
  std::string cache_path() const;
  void clear_memory();  // tests: forget every in-memory decision (the file stays)

  // The test hook tuner_slow_candidate (common/test_hooks.h): an algorithm's code, every candidate
  // (kEveryCandidate: candidates that cost the same) or every candidate but algorithm a (kAllBut - a: one clearly
  // faster).
  static constexpr int kEveryCandidate = -2;
  static constexpr int kAllBut = -100;
  // How much longer the tuning call about to run must take under that hook; always 0 in the product.
  int64_t slowdown_us(const CallArgs& call, c10d::ProcessGroup& group) const;

 private:
  struct State;
  void record(c10d::ProcessGroup& group, const std::string& bucket_key, double seconds, int64_t start_us,
              int64_t end_us);
  // Reads the bucket's pending device time, if any, into its last_seconds; false (call.error set) when it fails.
  bool resolve_pending_time(CallArgs& call, c10d::ProcessGroup& group, const std::string& bucket_key);
  AutoTuner();
  State* state_;  // never freed: calls may run during static destruction
};

}  // namespace gemm_ar
