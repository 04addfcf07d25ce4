#include "common/auto_tuner.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <unordered_map>
#include <sstream>

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include "common/host_clock.h"
#include "common/quantization.h"
#include "common/settings.h"
#include "common/test_hooks.h"
#include "common/tune_cache_file.h"
#include "common/tuning_race.h"

namespace gemm_ar {

namespace {

int64_t next_power_of_two(int64_t m) {
  int64_t p = 1;
  while (p < m) p <<= 1;
  return p;
}

}  // namespace

// A bucket's identity in numbers (the fields of its key, plus the group's name): decided calls look their bucket up
// by it, without composing the key's text, which would cost a noticeable share of a short decode call.
struct FastKey {
  std::string group;
  std::array<int64_t, 9> fields{};  // op, world, M bucket, K, N, dtype, bias, device type, fused
  bool operator==(const FastKey& o) const { return fields == o.fields && group == o.group; }
};
struct FastKeyHash {
  size_t operator()(const FastKey& k) const {
    size_t h = std::hash<std::string>{}(k.group);
    for (int64_t f : k.fields) h = h * 1000003u ^ std::hash<int64_t>{}(f);
    return h;
  }
};

// A shape bucket of one group: its race (common/tuning_race.h), then its decision.
struct TuneBucket : TuningRace {
  std::string key;                             // persisted key: op, world, M bucket, K, N, dtype, bias, device, fused
  FastKey fast;                                // the same, as numbers
  int64_t step = 0;                            // next tuning step (0: the bucket is met by its next call)
  double last_seconds = 0;                     // this rank's time of the previous step
  int64_t last_start_us = 0, last_end_us = 0;  // ... on this host's monotonic clock (0: timed on a device)
  std::function<double()> pending_seconds;     // ... when a device clock still has to be read (record_pending)
  bool decided = false;
  Algorithm decision = Algorithm::Sequential;
  uint64_t last_used = 0;  // the group's call clock: least recently used buckets go first
};

// Bounds that keep a process whose shapes never repeat from growing: per group (evicted least recently used first,
// by the group's own call order, which is the same on every rank, so ranks evict alike), decisions remembered
// for decisions(), and entries per fingerprint in the cache file.
constexpr size_t kMaxBucketsPerGroup = 512;
constexpr size_t kMaxDecisionsKept = 1024;
constexpr size_t kMaxCachedPerHost = 4096;

struct GroupTuning {
  const c10d::ProcessGroup* identity = nullptr;  // a new group under a reused name starts afresh
  uint64_t clock = 0;
  std::map<std::string, TuneBucket> buckets;  // by bucket key
};

struct DecidedBucket {
  const c10d::ProcessGroup* identity;
  GroupTuning* tuning;
  TuneBucket* bucket;
};

struct AutoTuner::State {
  mutable std::mutex mutex;
  std::map<std::string, GroupTuning> groups;  // by group name
  // Decided buckets by FastKey. Points into `groups`: emptied whenever a group or bucket is erased (rare), so that
  // it never points at one that is gone.
  std::unordered_map<FastKey, DecidedBucket, FastKeyHash> decided;

  // The bucket `key` of `group`, created (and the least recently used one evicted) when new.
  TuneBucket& bucket(c10d::ProcessGroup& group, const std::string& key) {
    const std::string name = group.getGroupName();
    auto found = groups.find(name);
    if (found == groups.end()) {
      forget_gone_groups();
      found = groups.emplace(name, GroupTuning{}).first;
    }
    GroupTuning& g = found->second;
    if (g.identity != &group) {
      decided.clear();
      g = GroupTuning{};
      g.identity = &group;
    }
    TuneBucket& b = g.buckets[key];
    b.last_used = ++g.clock;
    if (g.buckets.size() > kMaxBucketsPerGroup) {
      auto oldest = g.buckets.begin();
      for (auto it = g.buckets.begin(); it != g.buckets.end(); ++it) {
        if (it->second.last_used < oldest->second.last_used) oldest = it;
      }
      decided.clear();
      g.buckets.erase(oldest);  // never `b`: it was used last
    }
    return b;
  }

  TuneBucket* find(c10d::ProcessGroup& group, const std::string& key) {
    auto g = groups.find(group.getGroupName());
    if (g == groups.end() || g->second.identity != &group) return nullptr;
    auto b = g->second.buckets.find(key);
    return b == g->second.buckets.end() ? nullptr : &b->second;
  }

  void forget_gone_groups() {
    for (auto it = groups.begin(); it != groups.end();) {
      bool gone = true;
      try {
        gone = c10d::resolve_process_group(it->first).get() != it->second.identity;
      } catch (const std::exception&) {
      }
      if (gone) decided.clear();
      it = gone ? groups.erase(it) : std::next(it);
    }
  }

  void remember(TunerDecision decision) {
    if (decisions.size() >= kMaxDecisionsKept) decisions.erase(decisions.begin());
    decisions.push_back(std::move(decision));
  }
  TuneCacheFile file;
  bool file_loaded = false;
  std::string fingerprint = host_fingerprint();
  std::vector<TunerDecision> decisions;
  std::function<void(const std::string&)> logger;
};

AutoTuner::AutoTuner() : state_(new State()) {}

AutoTuner& AutoTuner::instance() {
  static AutoTuner* tuner = new AutoTuner();
  return *tuner;
}

bool AutoTuner::enabled() { return env_int(Setting::kAutotune, 1, 0, 1) == 1; }

std::string AutoTuner::cache_path() const {
  if (const char* path = env_text(Setting::kTuneCache); path != nullptr && *path) return path;
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  const std::string base = xdg != nullptr && *xdg ? xdg : std::string(home != nullptr ? home : "/tmp") + "/.cache";
  return base + "/torch_gemm_ar/autotune.json";
}

namespace {

std::vector<Algorithm> candidates_for(const CallArgs& call, bool fused_available,
                                      const std::vector<Algorithm>& fused_variants) {
  std::vector<Algorithm> out;
  if (fused_available) out.push_back(Algorithm::Fused);
  for (const Algorithm variant : fused_variants) {
    if (fused_available && call.op == kOpGemmAllreduce && fused_family_of(variant) != 0) out.push_back(variant);
  }
  out.push_back(Algorithm::Sequential);
  // Chunked differs from sequential only when every chunk has rows, and only gemm_allreduce-shaped ops have it.
  if ((call.op == kOpGemmAllreduce || call.op == kOpGemmAllreduceAddRmsnorm) && call.m >= 2 * chunk_count()) {
    out.push_back(Algorithm::Chunked);
  }
  return out;
}

// A bucket's identity: the one place that lays out its fields.
FastKey bucket_of(const std::string& group_name, int64_t op, int64_t world, int64_t m, int64_t k, int64_t n,
                  int64_t format, bool bias, c10::DeviceType device, bool fused_available) {
  return FastKey{group_name,
                 {op, world, next_power_of_two(m), k, n, format, bias ? 1 : 0, static_cast<int64_t>(device),
                  fused_available ? 1 : 0}};
}

FastKey fast_key(const CallArgs& call, c10d::ProcessGroup& group, const at::Device& device, bool fused_available) {
  return bucket_of(group.getGroupName(), call.op, group.getSize(), call.m, call.k, call.n, numeric_format(call),
                   call.bias.has_value(), device.type(), fused_available);
}

// The bucket's persisted key (the tune cache's format), written out from its numeric identity.
std::string bucket_key(const FastKey& fast) {
  const auto& f = fast.fields;
  std::ostringstream os;
  os << "op=" << f[0] << ";world=" << f[1] << ";m<=" << f[2] << ";k=" << f[3] << ";n=" << f[4]
     << ";dtype=" << numeric_format_name(f[5]) << ";bias=" << f[6]
     << ";device=" << c10::DeviceTypeName(static_cast<c10::DeviceType>(f[7]), /*lower_case=*/true) << ";fused=" << f[8];
  return tune_cache_text(os.str());
}

// The previous step's time as the group saw it. On one time line: from the last rank's start to the last rank's
// end (what a tensor-parallel step waits for once everyone has arrived; an early rank's wait for a late one is
// not the algorithm's cost). Otherwise the slowest rank's own time.
double run_seconds(const std::vector<CallSignature>& all, bool from_last_start) {
  bool one_clock = from_last_start;
  int64_t last_start = 0, last_end = 0, slowest = 0;
  for (const auto& s : all) {
    one_clock = one_clock && s[kSigTuneClock] != 0 && s[kSigTuneClock] == all[0][kSigTuneClock] &&
                s[kSigTuneLastStartUs] > 0 && s[kSigTuneLastEndUs] >= s[kSigTuneLastStartUs];
    last_start = std::max(last_start, s[kSigTuneLastStartUs]);
    last_end = std::max(last_end, s[kSigTuneLastEndUs]);
    slowest = std::max(slowest, s[kSigTuneLastUs]);
  }
  return static_cast<double>(one_clock ? last_end - last_start : slowest) * 1e-6;
}

}  // namespace

Algorithm AutoTuner::before_agreement(CallArgs& call, c10d::ProcessGroup& group, bool fused_available,
                                      Algorithm static_choice, bool may_tune,
                                      const std::function<std::vector<Algorithm>()>& fused_variants) {
  if (call.m == 0 || !call.error.empty()) return static_choice;  // nothing to measure
  State& st = *state_;
  const at::Device device = call.b.defined() ? call.b.device() : at::Device(at::kCPU);
  FastKey fast = fast_key(call, group, device, fused_available);
  {
    std::lock_guard<std::mutex> lock(st.mutex);
    auto hit = st.decided.find(fast);
    if (hit != st.decided.end() && hit->second.identity == &group) {
      hit->second.bucket->last_used = ++hit->second.tuning->clock;  // as bucket() does: eviction stays alike
      return hit->second.bucket->decision;
    }
  }
  const std::string key = bucket_key(fast);
  if (!may_tune) {  // a decision made earlier in this process, else the static policy; no tuning state is touched
    std::lock_guard<std::mutex> lock(st.mutex);
    const TuneBucket* known = st.find(group, key);
    return known != nullptr && known->decided ? known->decision : static_choice;
  }
  if (!resolve_pending_time(call, group, key)) return static_choice;  // call.error says why, on every rank
  std::lock_guard<std::mutex> lock(st.mutex);
  call.tune_bucket = key;
  TuneBucket& bucket = st.bucket(group, key);
  if (bucket.decided) return bucket.decision;
  if (bucket.step == 0) {
    bucket.key = key;
    bucket.fast = std::move(fast);
    bucket.candidates =
        candidates_for(call, fused_available, fused_variants ? fused_variants() : std::vector<Algorithm>{});
    if (bucket.candidates.size() == 1) {
      // Nothing to choose between (sequential, the only candidate without fused or a row per chunk): decided at
      // once, so the next calls take the fast path (before, each call built the bucket again and dropped it).
      bucket.decided = true;
      bucket.decision = bucket.candidates.front();
      st.decided[bucket.fast] = DecidedBucket{&group, &st.groups[group.getGroupName()], &bucket};
      return bucket.decision;
    }
    bucket.samples.assign(bucket.candidates.size(), {});
    bucket.beaten.assign(bucket.candidates.size(), false);
    bucket.rounds = 0;
    bucket.warming_up = true;
    bucket.warm_up_seconds = 0;
    if (!st.file_loaded) {
      load_tune_cache(cache_path(), st.file);
      st.file_loaded = true;
    }
    auto section = st.file.find(st.fingerprint);
    if (section != st.file.end()) {
      auto hit = section->second.find(key);
      if (hit != section->second.end()) call.tune_cached = static_cast<int64_t>(*parse_tuned_algorithm(hit->second));
    }
  }
  call.tune_step = bucket.step;
  call.tune_last_us = static_cast<int64_t>(bucket.last_seconds * 1e6);
  call.tune_last_start_us = bucket.last_start_us;
  call.tune_last_end_us = bucket.last_end_us;
  call.tune_clock = bucket.last_start_us > 0 ? monotonic_clock_domain() : 0;
  return Algorithm::Auto;
}

Algorithm AutoTuner::after_agreement(const CallArgs& call, c10d::ProcessGroup& group,
                                     const std::vector<CallSignature>& all) {
  State& st = *state_;
  std::string message;
  Algorithm run;
  {
    std::lock_guard<std::mutex> lock(st.mutex);
    TuneBucket& bucket = st.bucket(group, call.tune_bucket);
    const int64_t step = bucket.step;
    if (step == 0) {
      // A cached decision counts only when every rank has the same one (ranks on other hosts may not).
      bool same = call.tune_cached >= 0;
      for (const auto& s : all) same = same && s[kSigTuneCached] == call.tune_cached;
      const auto cached = static_cast<Algorithm>(call.tune_cached);
      if (same && std::find(bucket.candidates.begin(), bucket.candidates.end(), cached) != bucket.candidates.end()) {
        bucket.decided = true;
        bucket.decision = cached;
        st.remember({group.getGroupName(), bucket.key, algorithm_name(cached), "cache", {}, {}, {}});
        message = "torch_gemm_ar auto: group '" + group.getGroupName() + "' " + bucket.key + " -> " +
                  algorithm_name(cached) + " (from the tune cache, every rank agreeing)";
      } else {
        plan_round(bucket);
      }
    } else {
      bucket.samples[bucket.order[bucket.position]].push_back(
          run_seconds(all, /*from_last_start=*/!test_hooks::tuner_own_time()));
      if (++bucket.position == bucket.order.size()) {
        if (race_over(bucket)) {
          const size_t winner = trusted_leader(bucket);
          TunerDecision decision{
              group.getGroupName(), bucket.key, algorithm_name(bucket.candidates[winner]), "measured", {}, {}, {}};
          std::ostringstream os;
          os << "torch_gemm_ar auto: group '" << group.getGroupName() << "' " << bucket.key << " -> "
             << decision.algorithm
             << " (median of its runs, from the last rank's start, and relative to each round's "
                "fastest run:";
          for (size_t i = 0; i < bucket.candidates.size(); ++i) {
            const char* name = algorithm_name(bucket.candidates[i]);
            decision.candidate_us.emplace_back(name, median(bucket.samples[i]) * 1e6);
            decision.candidate_runs.emplace_back(name, static_cast<int64_t>(bucket.samples[i].size()));
            decision.candidate_relative.emplace_back(name, relative_time(bucket, i));
            char relative[32];
            std::snprintf(relative, sizeof relative, "%.3f", decision.candidate_relative.back().second);
            os << " " << name << " " << static_cast<int64_t>(decision.candidate_us.back().second) << " us (" << relative
               << "x its rounds' fastest) in " << bucket.samples[i].size() << " runs"
               << (bucket.beaten[i] ? " (out of the race)" : "") << (i + 1 < bucket.candidates.size() ? "," : "");
          }
          os << ")";
          message = os.str();
          bucket.decided = true;
          bucket.decision = bucket.candidates[winner];
          st.remember(std::move(decision));
          st.file[st.fingerprint][bucket.key] = algorithm_name(bucket.decision);
          update_tune_cache(cache_path(), st.file, st.fingerprint, bucket.key, kMaxCachedPerHost);
        } else {
          plan_round(bucket);
        }
      }
    }
    if (bucket.decided) {
      run = bucket.decision;
      auto& g = st.groups[group.getGroupName()];
      st.decided[bucket.fast] = DecidedBucket{&group, &g, &bucket};
    } else {
      run = bucket.candidates[bucket.order[bucket.position]];
      bucket.step = step + 1;
    }
  }
  if (!message.empty() && st.logger) st.logger(message);
  return run;
}

void AutoTuner::record(const CallArgs& call, c10d::ProcessGroup& group, int64_t start_us, int64_t end_us) {
  record(group, call.tune_bucket, static_cast<double>(end_us - start_us) * 1e-6, start_us, end_us);
}

void AutoTuner::record(c10d::ProcessGroup& group, const std::string& key, double seconds, int64_t start_us,
                       int64_t end_us) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  TuneBucket* bucket = state_->find(group, key);
  if (bucket == nullptr || bucket->decided) return;
  bucket->last_seconds = seconds;
  bucket->last_start_us = start_us;
  bucket->last_end_us = end_us;
}

void AutoTuner::record_pending(const CallArgs& call, c10d::ProcessGroup& group, std::function<double()> seconds) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  TuneBucket* bucket = state_->find(group, call.tune_bucket);
  if (bucket != nullptr && !bucket->decided) bucket->pending_seconds = std::move(seconds);
}

bool AutoTuner::resolve_pending_time(CallArgs& call, c10d::ProcessGroup& group, const std::string& key) {
  std::function<double()> pending;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    TuneBucket* bucket = state_->find(group, key);
    if (bucket == nullptr || !bucket->pending_seconds) return true;
    pending = std::move(bucket->pending_seconds);
    bucket->pending_seconds = nullptr;
  }
  double seconds = 0;
  try {
    seconds = pending();  // may wait for the device (bounded): outside the lock, other groups' calls go on
  } catch (const std::exception& e) {
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    call.error_code = kTuningClockError;
    call.error = call.op_name + ": timing the previous tuning call of this shape on the device failed: " +
                 (error != nullptr ? error->what_without_backtrace() : e.what());
    return false;
  }
  record(group, key, seconds, 0, 0);  // a device's time: no common time line with the peers
  return true;
}

void AutoTuner::reset(const CallArgs& call, c10d::ProcessGroup& group) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto g = state_->groups.find(group.getGroupName());
  state_->decided.clear();
  if (g != state_->groups.end()) g->second.buckets.erase(call.tune_bucket);
}

std::string AutoTuner::decision_for(const std::string& group_name, int64_t world, int64_t m, int64_t k, int64_t n,
                                    at::ScalarType dtype, bool bias, c10::DeviceType device) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto g = state_->groups.find(group_name);
  if (g == state_->groups.end()) return "";
  try {  // a group destroyed and created again under its name: the old one's decisions are not its
    if (c10d::resolve_process_group(group_name).get() != g->second.identity) return "";
  } catch (const std::exception&) {
    return "";
  }
  for (const bool fused : {true, false}) {  // whether fused was available: the bucket of the calls made
    const FastKey fast =
        bucket_of(group_name, kOpGemmAllreduce, world, m, k, n, static_cast<int64_t>(dtype), bias, device, fused);
    auto b = g->second.buckets.find(bucket_key(fast));
    if (b != g->second.buckets.end() && b->second.decided) return algorithm_name(b->second.decision);
  }
  return "";
}

bool AutoTuner::in_progress(const std::string& group_name) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  for (const auto& [name, g] : state_->groups) {
    if (!group_name.empty() && name != group_name) continue;
    for (const auto& [key, bucket] : g.buckets) {
      if (bucket.step > 0 && !bucket.decided) return true;
    }
  }
  return false;
}

int64_t AutoTuner::slowdown_us(const CallArgs& call, c10d::ProcessGroup& group) const {
  const int64_t slow = test_hooks::tuner_slow_candidate();
  if (slow == -1) return 0;  // none (kEveryCandidate is -2)
  std::lock_guard<std::mutex> lock(state_->mutex);
  const TuneBucket* bucket = state_->find(group, call.tune_bucket);
  if (bucket == nullptr || bucket->decided || bucket->order.empty()) return 0;
  const int running = static_cast<int>(bucket->candidates[bucket->order[bucket->position]]);
  const bool is_slow = slow == kEveryCandidate || running == slow || (slow <= kAllBut && running != kAllBut - slow);
  return is_slow ? test_hooks::tuner_slow_us() : 0;
}

std::vector<TunerDecision> AutoTuner::decisions() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->decisions;
}

void AutoTuner::set_logger(std::function<void(const std::string&)> logger) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->logger = std::move(logger);
}

void AutoTuner::clear_memory() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->decided.clear();
  state_->groups.clear();
  state_->decisions.clear();
  state_->file.clear();
  state_->file_loaded = false;
}

}  // namespace gemm_ar
