#include "common/tuning_race.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "common/settings.h"

namespace gemm_ar {
namespace {

double quantile(std::vector<double> v, size_t numerator, size_t denominator) {
  if (v.empty()) return 0.0;
  const auto q = v.begin() + static_cast<std::ptrdiff_t>((v.size() - 1) * numerator / denominator);
  std::nth_element(v.begin(), q, v.end());
  return *q;
}

int64_t min_reps() { return env_int(Setting::kAutotuneReps, 3, 1, 100); }
int64_t max_reps() { return std::max(min_reps(), env_int(Setting::kAutotuneMaxReps, 25, 1, 1000)); }
double budget_seconds() { return static_cast<double>(env_int(Setting::kAutotuneBudgetMs, 2000, 0, 3'600'000)) * 1e-3; }

// How much slower than the leader a candidate must be in three rounds of four to leave the race: candidates that
// cost the same stay in it (either would do; the margin keeps timer jitter from deciding).
constexpr double kClearlySlower = 1.02;
// Runs before a candidate may leave (docs/decisions/0002-algorithms-and-measured-auto.md): with 3, two slower rounds
// of three would suffice, and one burst of load from elsewhere can then take out a clearly faster candidate.
constexpr int64_t kRunsBeforeLeaving = 4;

// Candidate i's runs, each over the fastest run of its round (1.0: it was the round's fastest). samples[i][r] is
// candidate i's run in round r: every candidate runs once per round until it leaves the race.
std::vector<double> relative_runs(const TuningRace& bucket, size_t i) {
  std::vector<double> out;
  for (size_t r = 0; r < bucket.samples[i].size(); ++r) {
    double fastest = bucket.samples[i][r];
    for (const auto& runs : bucket.samples) {
      if (r < runs.size()) fastest = std::min(fastest, runs[r]);
    }
    out.push_back(fastest > 0 ? bucket.samples[i][r] / fastest : 1.0);
  }
  return out;
}

// Candidate i's runs over the leader's, round by round (the rounds both ran).
std::vector<double> paired_ratios(const TuningRace& bucket, size_t i, size_t lead) {
  std::vector<double> out;
  const auto& mine = bucket.samples[i];
  const auto& theirs = bucket.samples[lead];
  for (size_t r = 0; r < std::min(mine.size(), theirs.size()); ++r) {
    if (theirs[r] > 0) out.push_back(mine[r] / theirs[r]);
  }
  return out;
}

// Over kClearlySlower in at least three of every four rounds (three of four, four of five, five of six, ...).
bool clearly_slower(const std::vector<double>& ratios) {
  const auto slower = std::count_if(ratios.begin(), ratios.end(), [](double r) { return r > kClearlySlower; });
  return !ratios.empty() && 4 * static_cast<size_t>(slower) >= 3 * ratios.size();
}

}  // namespace

// A candidate's time is the median of its runs (what a steady stream of calls mostly costs: a gloo all_reduce's long
// wake-up tail is part of sequential's cost).
double median(const std::vector<double>& v) { return quantile(v, 1, 2); }

double relative_time(const TuningRace& bucket, size_t i) { return median(relative_runs(bucket, i)); }

// The candidate still in the race with the lowest median relative to its rounds' fastest runs.
size_t race_leader(const TuningRace& bucket) {
  size_t best = bucket.candidates.size();
  double best_time = 0;
  for (size_t i = 0; i < bucket.candidates.size(); ++i) {
    if (bucket.beaten[i]) continue;
    const double t = relative_time(bucket, i);
    if (best == bucket.candidates.size() || t < best_time) {
      best = i;
      best_time = t;
    }
  }
  return best;
}

// The race's leader, except that one of the backend's fused variants (another tile family, the gathered-inputs flow)
// replaces the rules' fused only when the median of its own runs is also the lower one: with few runs a variant can
// lead by its rounds while its own runs are slower than fused's, and then run slower than fused
// (docs/journal/performance-journal.md). Decided from the agreed samples, so alike on every rank.
size_t trusted_leader(const TuningRace& bucket) {
  const size_t lead = race_leader(bucket);
  if (lead == bucket.candidates.size() || fused_family_of(bucket.candidates[lead]) == 0) return lead;
  for (size_t i = 0; i < bucket.candidates.size(); ++i) {
    if (bucket.candidates[i] == Algorithm::Fused && !bucket.samples[i].empty() &&
        median(bucket.samples[i]) < median(bucket.samples[lead])) {
      return i;
    }
  }
  return lead;
}

// After a complete round: takes clear losers out of the race; true when the bucket is decided.
bool race_over(TuningRace& bucket) {
  if (bucket.warming_up) {
    bucket.warming_up = false;
    for (auto& runs : bucket.samples) {
      for (double t : runs) bucket.warm_up_seconds += t;
      runs.clear();
    }
    return false;
  }
  ++bucket.rounds;
  if (bucket.rounds < min_reps()) return false;
  const bool may_leave = bucket.rounds >= kRunsBeforeLeaving;
  const size_t lead = race_leader(bucket);
  size_t running = 0;
  double spent = bucket.warm_up_seconds, next_round = 0;
  for (size_t i = 0; i < bucket.candidates.size(); ++i) {
    for (double t : bucket.samples[i]) spent += t;
    if (may_leave && !bucket.beaten[i] && i != lead && clearly_slower(paired_ratios(bucket, i, lead))) {
      bucket.beaten[i] = true;
    }
    if (!bucket.beaten[i]) {
      ++running;
      next_round += median(bucket.samples[i]);
    }
  }
  return running <= 1 || bucket.rounds >= max_reps() || spent + next_round > budget_seconds();
}

// The next round's order: the candidates still in the race, in the orders of a Williams design, so that over the
// rounds each comes right after each other alike (what ran just before a call changes its time; rotating one order
// would keep every candidate's predecessor).
void plan_round(TuningRace& bucket) {
  std::vector<size_t> running;
  for (size_t i = 0; i < bucket.candidates.size(); ++i) {
    if (!bucket.beaten[i]) running.push_back(i);
  }
  const size_t n = running.size();
  const size_t orders = n % 2 == 0 ? n : 2 * n;  // n orders balance an even n; an odd n also needs them mirrored
  const size_t round = static_cast<size_t>(bucket.rounds) % orders;
  bucket.order.assign(n, 0);
  for (size_t j = 0; j < n; ++j) {
    // The first order is 0, 1, n-1, 2, n-2, ...; order r adds r (mod n) to it.
    const size_t first = j == 0 ? 0 : j % 2 == 1 ? (j + 1) / 2 : n - j / 2;
    bucket.order[round < n ? j : n - 1 - j] = running[(first + round) % n];
  }
  bucket.position = 0;
}

std::string decide_from_samples(const std::vector<std::string>& names, const std::vector<std::vector<double>>& samples,
                                bool trust_medians) {
  TORCH_CHECK_VALUE(!names.empty() && names.size() == samples.size(),
                    "decide_from_samples: one list of samples per candidate name");
  TuningRace bucket;
  for (const auto& name : names) {
    const auto algorithm = parse_tuned_algorithm(name);
    TORCH_CHECK_VALUE(algorithm.has_value(), "decide_from_samples: unknown candidate '", name, "'");
    bucket.candidates.push_back(*algorithm);
  }
  bucket.samples = samples;
  bucket.beaten.assign(names.size(), false);
  return algorithm_name(bucket.candidates[trust_medians ? trusted_leader(bucket) : race_leader(bucket)]);
}

}  // namespace gemm_ar
