#include "common/rank_agreement.h"

#include <atomic>
#include <cstring>
#include <sstream>

#include "common/current_op.h"
#include "common/quantization.h"
#include "common/settings.h"

namespace gemm_ar {

const char* const kTuneStepFieldName =
    "the `auto` tuning step (ranks met this shape a different number of times; tuning restarts with the next call)";

namespace {

const char* const kFieldNames[kSigComparedFields] = {"error",
                                                     "M",
                                                     "K",
                                                     "N",
                                                     "dtype (with the quantization: scheme, scale kinds, "
                                                     "out_dtype)",
                                                     "bias",
                                                     "algorithm",
                                                     "tile rows (TORCH_GEMM_AR_CPU_TILE or the CPU engine's "
                                                     "geometry options)",
                                                     "tile columns (TORCH_GEMM_AR_CPU_TILE or the CPU engine's "
                                                     "geometry options)",
                                                     "subtile rows (TORCH_GEMM_AR_CPU_TILE or the CPU engine's "
                                                     "geometry options)",
                                                     "compute threads (TORCH_GEMM_AR_COMPUTE_THREADS)",
                                                     "comm threads (TORCH_GEMM_AR_COMM_THREADS)",
                                                     "op",
                                                     "the op's parameter (scatter_dim/gather_dim and a's rows from "
                                                     "it on, or eps)",
                                                     kTuneStepFieldName,
                                                     "the CPU engine's options (torch_gemm_ar.engine_options, "
                                                     "TORCH_GEMM_AR_SHARED_OUTPUTS, whether TORCH_GEMM_AR_CPU_TILE "
                                                     "is set)"};

// The sequence-parallel ops compare their sharded dim together with the rows of one chunk along it and the dims
// after it (K excluded): [2, 6, K] and [4, 3, K] along dim 1 agree on M but not on how rows interleave by rank.
constexpr int64_t kShardRowsUnit = 256;  // above any dim index

int64_t shard_parameter(const CallArgs& call) {
  if (call.op != kOpGemmReduceScatter && call.op != kOpAllgatherGemm) return call.shard_dim;
  int64_t rows = 1;
  for (size_t d = call.shard_dim; d + 1 < call.out_shape.size(); ++d) rows *= call.out_shape[d];
  return call.shard_dim + kShardRowsUnit * rows;
}

const char* op_kind_name(int64_t op) {
  switch (op) {
    case kOpGemmAllreduce: return "gemm_allreduce";
    case kOpGemmReduceScatter: return "gemm_reduce_scatter";
    case kOpAllgatherGemm: return "allgather_gemm";
    case kOpGemmAllreduceAddRmsnorm: return "gemm_allreduce_add_rmsnorm";
  }
  return "?";
}

std::string field_value(int64_t field, int64_t value, int64_t op) {
  if (field == kSigShardDim && op == kOpGemmAllreduceAddRmsnorm) {  // the field carries eps's bits for this op
    double eps;
    std::memcpy(&eps, &value, sizeof eps);
    std::ostringstream os;
    os << "eps=" << eps;
    return os.str();
  }
  if (field == kSigShardDim && (op == kOpGemmReduceScatter || op == kOpAllgatherGemm)) {
    return "dim " + std::to_string(value % kShardRowsUnit) + " with " + std::to_string(value / kShardRowsUnit) +
           " rows per chunk";
  }
  if (field == kSigDtype) return numeric_format_name(value);
  if (field == kSigBias) return value ? "given" : "None";
  if (field == kSigAlgorithm) return algorithm_name(static_cast<Algorithm>(value));
  if (field == kSigOp) return op_kind_name(value);
  return std::to_string(value);
}

}  // namespace

const char* signature_field_name(int64_t field) {
  return field >= 0 && field < kSigComparedFields ? kFieldNames[field] : nullptr;
}

CallSignature call_signature(const CallArgs& call, Algorithm chosen) {
  CallSignature s{};
  s[kSigError] = call.error_code;
  s[kSigM] = call.m;
  s[kSigK] = call.k;
  s[kSigN] = call.n;
  s[kSigDtype] = numeric_format(call);
  s[kSigBias] = call.bias.has_value() ? 1 : 0;
  s[kSigAlgorithm] = static_cast<int64_t>(chosen);
  s[kSigOp] = call.op;
  s[kSigShardDim] = shard_parameter(call);
  s[kSigTuneStep] = call.tune_step;
  s[kSigTuneCached] = call.tune_cached;
  s[kSigTuneLastUs] = call.tune_last_us;
  s[kSigTuneLastStartUs] = call.tune_last_start_us;
  s[kSigTuneLastEndUs] = call.tune_last_end_us;
  s[kSigTuneClock] = call.tune_clock;
  return s;
}

std::string diagnose_signatures(const std::vector<CallSignature>& all, int rank, const CallArgs& mine,
                                const std::string& group_name) {
  const int world = static_cast<int>(all.size());
  std::ostringstream others;
  for (int r = 0; r < world; ++r) {
    if (all[r][kSigError] != 0 && r != rank) {
      others << (others.tellp() ? "; " : "") << "rank " << r << ": " << error_code_summary(all[r][kSigError]);
    }
  }
  std::ostringstream where;
  where << " [rank " << rank << " of group '" << group_name << "']";
  if (!mine.error.empty()) {
    return mine.error + where.str() + (others.tellp() ? " (also " + others.str() + ")" : std::string());
  }
  if (others.tellp()) {
    return mine.op_name + ": another rank rejected its arguments (" + others.str() +
           "); this rank's arguments were valid" + where.str();
  }
  auto disagreement = [&](int64_t f) {
    bool same = true;
    for (int r = 1; r < world; ++r) same = same && all[r][f] == all[0][f];
    if (same) return std::string();
    std::ostringstream os;
    os << mine.op_name << ": ranks of group '" << group_name << "' disagree on " << kFieldNames[f] << ":";
    for (int r = 0; r < world; ++r)
      os << (r ? "," : "") << " rank " << r << " has " << field_value(f, all[r][f], all[r][kSigOp]);
    return os.str();
  };
  // Causes before consequences: the op first (the op's parameter follows from it), the tile geometry last (it follows
  // from the shapes, the threads and the engine's options), so the message names what a user set differently.
  std::string problem = disagreement(kSigOp);
  for (int64_t f = kSigM; f < kSigComparedFields && problem.empty(); ++f) {
    if (f != kSigOp && f != kSigTileM && f != kSigTileN && f != kSigSubM) problem = disagreement(f);
  }
  for (int64_t f : {kSigTileM, kSigTileN, kSigSubM}) {
    if (problem.empty()) problem = disagreement(f);
  }
  return problem;
}

namespace {

constexpr int64_t kPiecesPerField = 4;  // 16-bit pieces of an int64 field: integers below 2^24 are exact in fp32
constexpr int64_t kTableSlotsPerRank = kSignatureFields * kPiecesPerField;

std::atomic<int64_t> payload_calls{0};

// One SUM all_reduce of `tensor` in place (each rank writes only its own rows of a table: an all-gather).
void exchange(c10d::ProcessGroup& group, at::Tensor& tensor) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.timeout = wait_timeout();
  group.allreduce(tensors, options)->wait(options.timeout);
}

std::vector<CallSignature> exchange_int64_table(c10d::ProcessGroup& group, const CallSignature& mine,
                                                const at::Device& device) {
  const int world = group.getSize();
  // One row per rank; each rank fills only its own, so a SUM all_reduce is an all-gather.
  auto table = at::zeros({world, kSignatureFields}, at::TensorOptions().dtype(at::kLong));
  for (int64_t f = 0; f < kSignatureFields; ++f) table[group.getRank()][f] = mine[f];
  at::Tensor moved = device.is_cpu() ? table : table.to(device);
  exchange(group, moved);
  auto gathered = moved.cpu();
  auto rows = gathered.accessor<int64_t, 2>();
  std::vector<CallSignature> all(world);
  for (int r = 0; r < world; ++r)
    for (int64_t f = 0; f < kSignatureFields; ++f) all[r][f] = rows[r][f];
  return all;
}

std::vector<CallSignature> exchange_cpu_buffer(c10d::ProcessGroup& group, const CallSignature& mine,
                                               AgreementPayload* payload) {
  const int world = group.getSize();
  const int64_t table_slots = world * kTableSlotsPerRank;
  auto buffer = at::zeros({table_slots + kAgreementPayloadSlots}, at::TensorOptions().dtype(at::kFloat));
  float* slots = buffer.data_ptr<float>();
  float* own = slots + group.getRank() * kTableSlotsPerRank;
  for (int64_t f = 0; f < kSignatureFields; ++f) {
    const auto bits = static_cast<uint64_t>(mine[f]);
    for (int64_t p = 0; p < kPiecesPerField; ++p)
      own[f * kPiecesPerField + p] = static_cast<float>((bits >> (16 * p)) & 0xFFFF);
  }
  if (payload != nullptr && payload->data.defined()) {
    TORCH_CHECK(payload->data.numel() <= kAgreementPayloadSlots && payload->data.scalar_type() == at::kFloat,
                current_op(), ": internal error: agreement payload too large or not fp32");
    buffer.narrow(0, table_slots, payload->data.numel()).copy_(payload->data.reshape({-1}));
  }
  exchange(group, buffer);
  const float* summed = buffer.data_ptr<float>();
  std::vector<CallSignature> all(world);
  for (int r = 0; r < world; ++r) {
    for (int64_t f = 0; f < kSignatureFields; ++f) {
      uint64_t bits = 0;
      for (int64_t p = 0; p < kPiecesPerField; ++p)
        bits |= static_cast<uint64_t>(summed[r * kTableSlotsPerRank + f * kPiecesPerField + p]) << (16 * p);
      all[r][f] = static_cast<int64_t>(bits);
    }
  }
  if (payload != nullptr && payload->data.defined()) {
    payload->data.reshape({-1}).copy_(buffer.narrow(0, table_slots, payload->data.numel()));
    payload->reduced = true;  // meaningful only if the signatures agree (checked next, before anyone uses it)
  }
  return all;
}

}  // namespace

bool agreement_problem_is_value_error(const std::vector<CallSignature>& all, const CallArgs& mine) {
  const auto not_an_argument = [](int64_t code) {
    return code == kFusedUnavailableError || code == kTuningClockError || code == kQuantizedUnavailableError;
  };
  if (mine.error_code != 0) return !not_an_argument(mine.error_code);  // this rank's own message is raised
  for (const auto& s : all) {
    if (not_an_argument(s[kSigError])) return false;
  }
  return true;
}

bool agreement_problem_is_not_implemented(const std::vector<CallSignature>& all, const CallArgs& mine) {
  if (mine.error_code != 0) return mine.error_code == kQuantizedUnavailableError;
  for (const auto& s : all) {
    if (s[kSigError] == kQuantizedUnavailableError) return true;
  }
  return false;
}

int64_t agreement_payload_calls() { return payload_calls.load(std::memory_order_relaxed); }

std::vector<CallSignature> check_ranks_agree(c10d::ProcessGroup& group, const CallArgs& call, Algorithm chosen,
                                             const at::Device& device) {
  const CallSignature mine = call_signature(call, chosen);
  std::vector<CallSignature> all =
      device.is_cpu() ? exchange_cpu_buffer(group, mine, call.payload) : exchange_int64_table(group, mine, device);
  std::string problem = diagnose_signatures(all, group.getRank(), call, group.getGroupName());
  if (call.payload != nullptr && call.payload->reduced) {
    if (problem.empty()) {
      payload_calls.fetch_add(1, std::memory_order_relaxed);  // a statistic for tests only: no ordering needed
    } else {
      call.payload->reduced = false;
    }
  }
  if (problem.empty()) return all;
  if (agreement_problem_is_value_error(all, call)) TORCH_CHECK_VALUE(false, problem);
  TORCH_CHECK_NOT_IMPLEMENTED(!agreement_problem_is_not_implemented(all, call), problem);
  TORCH_CHECK(false, problem);
  return all;
}

}  // namespace gemm_ar
