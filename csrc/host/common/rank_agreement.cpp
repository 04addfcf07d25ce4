#include "common/rank_agreement.h"

#include <sstream>

#include "common/settings.h"

namespace gemm_ar {
namespace {

// One row per rank; ranks fill only their own row, so a SUM all_reduce is an all-gather.
enum Field : int64_t { kErrorCode, kM, kK, kN, kDtype, kHasBias, kAlgorithm, kFields };
const char* const kFieldNames[kFields] = {"error", "M", "K", "N", "dtype", "bias", "algorithm"};

std::string field_value(int64_t field, int64_t value) {
  if (field == kDtype) return c10::toString(static_cast<at::ScalarType>(value));
  if (field == kHasBias) return value ? "given" : "None";
  if (field == kAlgorithm) return algorithm_name(static_cast<Algorithm>(value));
  return std::to_string(value);
}

}  // namespace

void check_ranks_agree(c10d::ProcessGroup& group, const CallArgs& call, const at::Device& device) {
  const int world = group.getSize();
  const int rank = group.getRank();
  auto table = at::zeros({world, kFields}, at::TensorOptions().dtype(at::kLong));
  auto row = table[rank];
  int64_t values[kFields] = {call.error_code, call.m, call.k, call.n, static_cast<int64_t>(call.dtype),
                             call.bias.has_value() ? 1 : 0, static_cast<int64_t>(call.algorithm)};
  for (int64_t f = 0; f < kFields; ++f) row[f] = values[f];
  std::vector<at::Tensor> tensors{device.is_cpu() ? table : table.to(device)};
  c10d::AllreduceOptions options;
  options.timeout = wait_timeout();
  group.allreduce(tensors, options)->wait(options.timeout);
  auto gathered = tensors[0].cpu();
  auto rows = gathered.accessor<int64_t, 2>();

  std::ostringstream bad;
  for (int r = 0; r < world; ++r) {
    if (rows[r][kErrorCode] != 0 && r != rank) {
      bad << (bad.tellp() ? "; " : "") << "rank " << r << ": " << error_code_summary(rows[r][kErrorCode]);
    }
  }
  if (!call.error.empty()) {
    TORCH_CHECK_VALUE(false, call.error, " [rank ", rank, " of group '", group.getGroupName(), "'",
                      bad.tellp() ? "; also " + bad.str() : std::string(), "]");
  }
  TORCH_CHECK_VALUE(bad.tellp() == 0, "gemm_allreduce: another rank rejected its arguments (", bad.str(),
                    "); this rank's arguments were valid [rank ", rank, " of group '", group.getGroupName(), "']");
  for (int64_t f = kM; f < kFields; ++f) {
    bool same = true;
    for (int r = 1; r < world; ++r) same = same && rows[r][f] == rows[0][f];
    if (same) continue;
    std::ostringstream os;
    os << "gemm_allreduce: ranks of group '" << group.getGroupName() << "' disagree on " << kFieldNames[f] << ":";
    for (int r = 0; r < world; ++r) os << (r ? "," : "") << " rank " << r << " has " << field_value(f, rows[r][f]);
    TORCH_CHECK_VALUE(false, os.str());
  }
}

}  // namespace gemm_ar
