// The race `auto` runs between its candidates on one shape bucket, and the decision it ends in (docs/usage.md, "`auto`
// by measurement"). First every candidate runs once, not counted (a warm-up round: a candidate's first call at a new
// shape grows windows and touches fresh pages, so it costs many times a steady call, and with such runs counted the
// race picks slower candidates; docs/journal/performance-journal.md).
// Then every candidate runs at least TORCH_GEMM_AR_AUTOTUNE_REPS (default 3) times; from its 4th run on, after each
// round, a candidate that is over 2% slower than the leader in three rounds of four (the lower quartile of its paired
// ratios to the leader) leaves the race, and the rest run more rounds, while the bucket's tuning has taken less than
// TORCH_GEMM_AR_AUTOTUNE_BUDGET_MS (default 2000) and a round fits in what is left, up to
// TORCH_GEMM_AR_AUTOTUNE_MAX_REPS (default 25) runs. The leader is the candidate with the lowest median of its runs
// relative to each round's fastest run. A shared machine's noise is wider than the gaps between candidates, so a
// fixed few runs each can pick a clearly slower one; close candidates get the runs that separate them, clear losers
// no more. The candidates of a round run back to back, so comparing them round by round cancels a slow spell that
// spans the round, which raw medians would count against the candidates that ran in it
// (docs/journal/performance-journal.md). The rounds' orders vary so that every candidate follows every other alike.
// Everything here is decided from the agreed samples, so alike on every rank.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/algorithm.h"

namespace gemm_ar {

struct TuningRace {
  std::vector<Algorithm> candidates;
  bool warming_up = true;                    // the first round is the warm-up round (not in `rounds`)
  double warm_up_seconds = 0;                // what it took (counts against the budget)
  int64_t rounds = 0;                        // rounds completed (each runs every candidate still in the race once)
  std::vector<std::vector<double>> samples;  // per candidate: each run as the group saw it, s (samples[i][r]: round r)
  std::vector<bool> beaten;                  // per candidate: out of the race (even its good runs trail the leader)
  std::vector<size_t> order;                 // this round's candidates, in the order they run
  size_t position = 0;                       // the entry of `order` that the previous step ran
};

double median(const std::vector<double>& v);
// Candidate i's median run over the fastest run of its rounds (1.0: it was always the fastest).
double relative_time(const TuningRace& race, size_t i);
// The candidate still in the race with the lowest relative_time (candidates.size() when none is).
size_t race_leader(const TuningRace& race);
// The leader, except that a fused variant (another tile family, the gathered-inputs flow) replaces the rules' fused
// only when the median of its own runs is also the lower one.
size_t trusted_leader(const TuningRace& race);
// After a complete round: ends the warm-up round (its samples dropped), or takes clear losers out of the race; true
// when the bucket is decided.
bool race_over(TuningRace& race);
// The next round's order (resets `position`).
void plan_round(TuningRace& race);

// The decision a race with these per-round samples (seconds; samples[i][r] is candidate i's run in round r) ends in,
// every candidate still in it: the leader by the median relative to each round's fastest run, and with
// trust_medians a fused variant only when its own median is also below fused's (tests of the rule).
std::string decide_from_samples(const std::vector<std::string>& names, const std::vector<std::vector<double>>& samples,
                                bool trust_medians = true);

}  // namespace gemm_ar
