// Argument checking and normalisation of one gemm_allreduce call (the rules of docs/architecture.md §1).
#pragma once
#include <ATen/ATen.h>
#include <gemm_ar/op_kind.hpp>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/algorithm.h"

namespace gemm_ar {

// A small `sequential` call's partial product riding on the agreement exchange over the process group, so that
// the exchange and the all_reduce are one collective (common/rank_agreement.h). `data`: fp32, at most
// kAgreementPayloadSlots elements; the exchange sums it over the ranks in place and sets `reduced`. Exchanges that
// cannot carry it (the CPU engine's shared windows, device tensors) leave `reduced` false.
struct AgreementPayload {
  at::Tensor data;
  bool reduced = false;
};

// Quantized inputs (docs/decisions/0020-quantized-ops.md): W8A8 multiplies int8 a by int8 b into int32 and
// dequantizes with a_scale (per token or one value) and b_scale (per output channel or one value); W8A16 multiplies a
// float a by int8 b dequantized with b_scale. Either way each rank's partial product is fp32 before the reduction.
enum class QuantScheme : int64_t { kNone = 0, kW8A8 = 1, kW8A16 = 2 };
// How a scale covers its operand: one value, or one per row of a (per token) / per column of b (per channel).
enum class ScaleKind : int64_t { kNone = 0, kPerTensor = 1, kPerRow = 2 };

// The quantization arguments as the op received them (all empty for a plain call).
struct QuantInputs {
  std::optional<at::Tensor> a_scale;
  std::optional<at::Tensor> b_scale;
  std::optional<at::ScalarType> out_dtype;
};

// A valid quantized call's parameters, normalised by prepare_call.
struct Quantization {
  QuantScheme scheme = QuantScheme::kNone;
  ScaleKind a_scale_kind = ScaleKind::kNone, b_scale_kind = ScaleKind::kNone;
  at::Tensor a_scale;  // fp32 [M] (per token, a's leading dims flattened) or [1]; undefined for W8A16
  at::Tensor b_scale;  // fp32 [N] or [1]
};

// What one rank can say about its own arguments before any data moves. `error` is empty when they are fine.
struct CallArgs {
  at::Tensor a2d;                  // [M, K], a's leading dims flattened (a view when a allows it)
  at::Tensor b;                    // [K, N], caller's strides kept (weight.t() is not copied)
  std::optional<at::Tensor> bias;  // [N]
  std::vector<int64_t> out_shape;  // a.shape[:-1] + [N]
  int64_t m = 0, k = 0, n = 0;
  at::ScalarType dtype = at::kFloat;      // a's dtype
  at::ScalarType out_dtype = at::kFloat;  // the result's: `dtype` unless the call is quantized
  Quantization quant;
  Algorithm algorithm = Algorithm::Auto;
  // The tile family a fused run takes (fused_family_of the algorithm that runs: set by the op's flow): 0 the CPU
  // engine's geometry rules, else the family `auto` measured faster here.
  int64_t fused_family = 0;
  std::string op_name = "gemm_allreduce";  // prefix of every message about this call
  int64_t op = 0;                          // which op (OpKind): ranks calling different ops disagree
  int64_t shard_dim = 0;  // scatter_dim / gather_dim of the sequence-parallel ops, normalised (0 otherwise)
  // `auto` tuning (common/auto_tuner.h): this call's step in tuning its bucket (-1: not a tuning call), this
  // rank's cached decision for the bucket (-1: none) and its time of the previous step in microseconds; where
  // that step started and ended on this host's monotonic clock `tune_clock` (all 0 when timed on a device).
  int64_t tune_step = -1, tune_cached = -1, tune_last_us = 0;
  int64_t tune_last_start_us = 0, tune_last_end_us = 0, tune_clock = 0;
  std::string tune_bucket;              // the tuner's name for this call's group and shape bucket
  std::string error;                    // the local error message, if any
  int64_t error_code = 0;               // nonzero with `error`: which check failed (shared with peers)
  AgreementPayload* payload = nullptr;  // set by the op flow for calls whose result may ride on the agreement
};

// The ops sharing this flow (signature field `op`): OpKind of gemm_ar/op_kind.hpp.

// Validates and normalises; never throws for bad user input (the message is carried in `error` so that every
// rank can raise together after the agreement exchange).
CallArgs prepare_call(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                      std::string_view algorithm, c10::DeviceType device_type,
                      const std::vector<at::ScalarType>& supported_dtypes, std::string_view op_name = "gemm_allreduce",
                      const QuantInputs& quant = {});

// Error code of a rank that was asked for algorithm='fused' where it cannot run.
constexpr int64_t kFusedUnavailableError = 8;
// Error codes of the sequence-parallel ops' own checks.
constexpr int64_t kBadShardDimError = 9;
constexpr int64_t kNotDivisibleError = 10;
constexpr int64_t kAlgorithmUnavailableError = 11;  // an algorithm this op does not implement yet
// Error codes of the add+RMSNorm epilogue's extra arguments (common/add_rmsnorm.cpp).
constexpr int64_t kBadResidualError = 12;
constexpr int64_t kBadNormWeightError = 13;
// A device clock of an earlier tuning call could not be read (its kernels did not finish in time): every rank
// raises (RuntimeError), none waits in the agreement for it.
constexpr int64_t kTuningClockError = 14;
// Error codes of the quantization arguments (common/quantization.cpp), each naming its argument for the peers.
constexpr int64_t kBadAScaleError = 15;
constexpr int64_t kBadBScaleError = 16;
constexpr int64_t kBadOutDtypeError = 17;
constexpr int64_t kQuantizedDtypesError = 18;
// Quantized arguments on a backend that has no quantized path yet (the NPU): every rank raises NotImplementedError.
constexpr int64_t kQuantizedUnavailableError = 19;

// Short description of an error code, used when another rank reports it.
const char* error_code_summary(int64_t code);

}  // namespace gemm_ar
