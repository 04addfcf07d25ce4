// Before any large data moves, ranks compare a few integers describing their call (the call signature), so that a
// bad argument on one rank, or ranks that disagree on shapes, dtype, bias or algorithm, raise a clear error on every
// rank instead of a hang or a silently wrong sum. Exchanged over the process group here, or through the shared
// window headers by the CPU engine.
#pragma once
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <array>
#include <vector>

#include "common/call_args.h"

namespace gemm_ar {

enum SignatureField : int64_t {
  kSigError,  // local error code (0: arguments valid)
  kSigM,
  kSigK,
  kSigN,
  kSigDtype,  // a's dtype; for a quantized call with the scheme, scale kinds and out dtype (common/quantization.h)
  kSigBias,
  kSigAlgorithm,
  kSigTileM,
  kSigTileN,
  kSigSubM,
  kSigComputeBlocks,
  kSigCommBlocks,  // fused-engine configuration (0 otherwise)
  kSigOp,
  kSigShardDim,    // which op (OpKind) and its parameter: scatter/gather dim, or eps's bits (add+RMSNorm)
  kSigTuneStep,    // `auto` tuning step of the call's bucket (-1: not tuning): ranks must be at the same one
  kSigEngineMode,  // CPU engine: its process-wide options that change how a call uses the windows (0 otherwise)
  kSigComparedFields,
  // Carried, not compared: what each rank tells the others for `auto` tuning (common/auto_tuner.h).
  kSigTuneCached = kSigComparedFields,  // this rank's cached decision for the bucket (-1: none)
  kSigTuneLastUs,                       // this rank's time of the previous tuning step, microseconds
  kSigTuneLastStartUs,
  kSigTuneLastEndUs,  // ... its start and end on this host's monotonic clock (0: not known)
  kSigTuneClock,      // which monotonic clock those are on (common/host_clock.h; 0: none)
  kSignatureFields
};
using CallSignature = std::array<int64_t, kSignatureFields>;

// The readable name of signature field `field` (kSigM: "M", ...); nullptr past the last field.
const char* signature_field_name(int64_t field);

// The name of the tuning-step field in disagreement messages (the op flow restarts tuning on it).
extern const char* const kTuneStepFieldName;

// The signature of `call` on this rank; `chosen` is the algorithm it will run (auto already resolved).
CallSignature call_signature(const CallArgs& call, Algorithm chosen);

// The error every rank raises for these signatures (identical text on every rank except the rank whose own
// arguments were bad, which sees its own message first), or "" when all ranks agree and all arguments are valid.
std::string diagnose_signatures(const std::vector<CallSignature>& all, int rank, const CallArgs& mine,
                                const std::string& group_name);

// Whether diagnose_signatures' problem is a bad argument or a disagreement (ValueError) rather than a failure that
// is not the caller's input, on this rank or another (RuntimeError: fused unavailable, a tuning clock unreadable).
bool agreement_problem_is_value_error(const std::vector<CallSignature>& all, const CallArgs& mine);
// Whether it is a feature a rank's backend lacks (quantized arguments on the NPU): NotImplementedError.
bool agreement_problem_is_not_implemented(const std::vector<CallSignature>& all, const CallArgs& mine);

// Exchanges signatures with one small all_reduce on `group` (bounded by TORCH_GEMM_AR_TIMEOUT_S) and throws the
// diagnosis, if any, on every rank. Returns every rank's signature.
// On CPU the exchange is one fp32 buffer of a fixed size -- the signature table, each field in 16-bit pieces
// (exact in fp32: only its own rank writes a piece), then kAgreementPayloadSlots data slots -- whatever the call,
// so ranks that disagree still issue collectives of one size (gloo aborts the process on a size mismatch). A call
// with `call.payload` puts its partial product in the data slots: when every rank agrees, the sum is its result
// and the call needs no second collective (docs/decisions/0004-rank-agreement-before-data-moves.md). A payload of
// a call whose signatures disagree is dropped with the error.
std::vector<CallSignature> check_ranks_agree(c10d::ProcessGroup& group, const CallArgs& call, Algorithm chosen,
                                             const at::Device& device);

// Data slots of the CPU agreement exchange: 64 KiB of fp32. A gloo all_reduce on one host is latency-bound at these
// sizes (64 KiB costs about what 1 KiB does), so calls that carry no payload lose little, and outputs of up to 16384
// elements (M=1 at N<=16384, M=8 at N=2048) save a whole round trip.
constexpr int64_t kAgreementPayloadSlots = 16384;

// How many calls of this process got their result from the agreement exchange (tests).
int64_t agreement_payload_calls();

}  // namespace gemm_ar
