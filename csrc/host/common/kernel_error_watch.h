// The host's side of the kernels' ErrorRecord (docs/decisions/0005-bounded-waits-and-failure-reporting.md), kept free
// of torch and torch_npu so that it can be tested anywhere with a fake record: which call of a communicator a record
// belongs to, whether it was already reported, and the message every report carries. The NPU code feeds it the pinned
// copy of the device record (refreshed asynchronously after every call) and raises what it returns.
#pragma once
#include <cstdint>
#include <string>

#include "gemm_ar/kernel_args.hpp"

namespace gemm_ar {

// Names of the signature words the kernels compare (the host's CallSignature fields); nullptr past the end.
using SignatureFieldName = const char* (*)(int64_t word);
// Short description of a host error code a rank published in word 0 of its signature.
using ErrorCodeSummary = const char* (*)(int64_t code);

std::string describe_kernel_error(const ErrorRecord& record, SignatureFieldName field_name,
                                  ErrorCodeSummary code_summary);

class KernelErrorWatch {
 public:
  // Calls on this communicator get epochs first_epoch, first_epoch + 1, ... (mod 2^32).
  explicit KernelErrorWatch(uint32_t first_epoch = 0) : first_epoch_(first_epoch) {}

  // The epoch the next call gets; counts the call.
  uint32_t take_epoch() { return first_epoch_ + calls_++; }
  uint64_t calls() const { return calls_; }

  // The message for a failure the record shows for one of this communicator's recent calls that was not reported
  // yet, or "" (no error, an old or foreign record, or already reported). Marks it reported. A rank's own rejection
  // of its arguments is never raised from the record: its host raised it when it queued the call (whatever epoch
  // the kernel then ran with, graph replays included); only a rejection by the kernel itself is.
  std::string take_unreported(const ErrorRecord& record, const std::string& group_name, SignatureFieldName field_name,
                              ErrorCodeSummary code_summary);

 private:
  uint32_t first_epoch_;
  uint64_t calls_ = 0;
  uint32_t reported_tag_ = 0;
};

}  // namespace gemm_ar
