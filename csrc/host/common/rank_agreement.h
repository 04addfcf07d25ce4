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
  kSigM, kSigK, kSigN, kSigDtype, kSigBias, kSigAlgorithm,
  kSigTileM, kSigTileN, kSigSubM, kSigComputeBlocks, kSigCommBlocks,  // fused-engine configuration (0 otherwise)
  kSigOp, kSigShardDim,  // which op (OpKind) and its parameter: scatter/gather dim, or eps's bits (add+RMSNorm)
  kSigTuneStep,          // `auto` tuning step of the call's bucket (-1: not tuning): ranks must be at the same one
  kSigComparedFields,
  // Carried, not compared: what each rank tells the others for `auto` tuning (common/auto_tuner.h).
  kSigTuneCached = kSigComparedFields,  // this rank's cached decision for the bucket (-1: none)
  kSigTuneLastUs,                       // this rank's time of the previous tuning step, microseconds
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

// Exchanges signatures with one small all_reduce on `group` (bounded by TORCH_GEMM_AR_TIMEOUT_S) and throws the
// diagnosis, if any, on every rank. Returns every rank's signature.
std::vector<CallSignature> check_ranks_agree(c10d::ProcessGroup& group, const CallArgs& call, Algorithm chosen, const at::Device& device);

}  // namespace gemm_ar
