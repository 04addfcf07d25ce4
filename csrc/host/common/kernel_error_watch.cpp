#include "common/kernel_error_watch.h"

#include <algorithm>
#include <sstream>

namespace gemm_ar {
namespace {

// How far back a record's tag is matched against this communicator's calls.
constexpr uint64_t kErrorEpochLookback = uint64_t{1} << 16;

}  // namespace

std::string describe_kernel_error(const ErrorRecord& e, SignatureFieldName field_name, ErrorCodeSummary code_summary) {
  std::ostringstream os;
  os << "rank " << e.rank;
  switch (e.code) {
    case kErrBadArgs: os << " rejected the kernel arguments (host and kernels built from different sources?)"; break;
    case kErrTimeoutCompute:
      os << " waited too long for its own GEMM kernel (ready queue slot " << e.item << ", comm block " << e.block
         << ")";
      break;
    case kErrTimeoutPrepare: os << " waited too long for rank " << e.peer << " to start the call"; break;
    case kErrTimeoutReduce:
      os << " waited too long for rank " << e.peer << "'s contribution to its subtile " << e.item;
      break;
    case kErrTimeoutGather:
      os << " waited too long for rank " << e.peer << " to deliver reduced subtile " << e.item;
      break;
    case kErrTimeoutRows:
      os << " waited too long for rank " << e.peer << "'s rows " << e.item << " of a to arrive (all-gather)";
      break;
    case kErrTimeoutConsumed:
      os << " waited too long for rank " << e.peer << " to finish reading its shard of a (all-gather)";
      break;
    case kErrAborted: os << " stopped because another of its blocks failed"; break;
    case kErrQueueCorrupt:
      os << " found an unexpected tile id in ready queue " << (e.item >> 32) << ", slot " << (e.item & 0xffffffff);
      break;
    case kErrSignatureMismatch: {
      const char* field = field_name != nullptr && e.item >= 0 ? field_name(e.item) : nullptr;
      if (e.item == -2) {
        os << " could not read rank " << e.peer << "'s call signature (torn or forged in the window)";
      } else {
        os << " and rank " << e.peer << " called with different " << (field != nullptr ? field : "signature word")
           << (field != nullptr ? "" : (" " + std::to_string(e.item)));
      }
      break;
    }
    case kErrPeerRejected: {
      const char* summary = code_summary != nullptr ? code_summary(e.item) : nullptr;
      os << ": rank " << e.peer << " rejected its arguments (" << (summary != nullptr ? summary : "error code ")
         << (summary != nullptr ? "" : std::to_string(e.item)) << ")";
      break;
    }
    default: os << " reported error code " << e.code; break;
  }
  return os.str();
}

std::string KernelErrorWatch::take_unreported(const ErrorRecord& record, const std::string& group_name,
                                              SignatureFieldName field_name, ErrorCodeSummary code_summary) {
  // Only this process's kernels write the record (zeroed when the communicator was set up), so every tag not yet
  // reported is a failure to raise; the call number is known for the eager calls this watch counted.
  if (record.code == kErrNone || record.tag == 0 || record.tag == reported_tag_) return "";
  const bool raised_by_host =
      record.code == kErrPeerRejected && record.peer == record.rank && record.item != kSignatureKernelRejected;
  if (raised_by_host) return "";
  reported_tag_ = record.tag;
  std::string which = "a call (replayed from a captured graph, or older than the last 65536)";
  for (uint64_t back = 1; back <= std::min(calls_, kErrorEpochLookback); ++back) {
    const uint32_t epoch = static_cast<uint32_t>(first_epoch_ + calls_ - back);
    if (signal_tag(epoch) == record.tag) {
      which = "call #" + std::to_string(calls_ - back + 1);
      break;
    }
  }
  std::ostringstream os;
  os << "gemm_allreduce (fused, NPU): " << which << " on group '" << group_name
     << "' failed: " << describe_kernel_error(record, field_name, code_summary)
     << ". Its output holds NaN (TORCH_GEMM_AR_TIMEOUT_S bounds every wait). The group stays usable: every rank "
        "counted the call; only a peer that died leaves it unusable.";
  return os.str();
}

}  // namespace gemm_ar
