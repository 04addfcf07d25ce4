#include "common/call_args.h"

#include <sstream>

#include "common/quantization.h"

namespace gemm_ar {
namespace {

enum ErrorCode : int64_t {
  kOk = 0,
  kBadA = 1,
  kBadB = 2,
  kKMismatch = 3,
  kBadBias = 4,
  kDtype = 5,
  kDevice = 6,
  kAlgorithm = 7,
};

std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

std::string dtype_list(const std::vector<at::ScalarType>& dtypes) {
  std::string out;
  for (auto d : dtypes) out += (out.empty() ? "" : ", ") + std::string(c10::toString(d));
  return out;
}

}  // namespace

const char* error_code_summary(int64_t code) {
  switch (code) {
    case kBadA: return "invalid `a` (must be 2-D or 3-D [..., K])";
    case kBadB: return "invalid `b` (must be 2-D [K, N])";
    case kKMismatch: return "`a` and `b` disagree on K";
    case kBadBias: return "invalid `bias` (must be 1-D [N], same dtype and device)";
    case kDtype: return "unsupported or mixed dtypes";
    case kDevice: return "tensors on the wrong or mixed devices";
    case kAlgorithm: return "unknown `algorithm`";
    case kFusedUnavailableError: return "algorithm='fused' is not available there";
    case kBadShardDimError: return "invalid scatter_dim/gather_dim";
    case kNotDivisibleError: return "size along scatter_dim not divisible by the world size";
    case kAlgorithmUnavailableError: return "algorithm not implemented for this op";
    case kBadResidualError: return "invalid `residual` (must have shape a.shape[:-1] + [N], a's dtype and device)";
    case kBadNormWeightError: return "invalid `norm_weight` (must be 1-D [N], a's dtype and device)";
    case kTuningClockError: return "an earlier tuning call's kernels did not finish in time";
    case kBadAScaleError: return "invalid `a_scale` (int8 a needs float32 per token or one value)";
    case kBadBScaleError: return "invalid `b_scale` (int8 b needs float32 [N] or one value)";
    case kBadOutDtypeError: return "invalid `out_dtype` (float32, bfloat16 or float16, for quantized calls)";
    case kQuantizedDtypesError: return "invalid quantized dtypes of `a` and `b` (int8 a needs int8 b)";
    case kQuantizedUnavailableError: return "quantized `a_scale`/`b_scale` arguments are not implemented there";
    default: return "invalid arguments";
  }
}

CallArgs prepare_call(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                      std::string_view algorithm, c10::DeviceType device_type,
                      const std::vector<at::ScalarType>& supported_dtypes, std::string_view op_name,
                      const QuantInputs& quant) {
  CallArgs call;
  call.op_name = std::string(op_name);
  auto fail = [&](ErrorCode code, const std::string& message) {
    call.error_code = code;
    call.error = call.op_name + ": " + message;
    return call;
  };
  auto parsed = parse_algorithm(algorithm);
  if (!parsed) {
    return fail(kAlgorithm, "algorithm must be one of " + std::string(algorithm_choices()) + "; got '" +
                                std::string(algorithm) + "'");
  }
  call.algorithm = *parsed;
  if (a.dim() != 2 && a.dim() != 3) {
    return fail(kBadA, "a must be 2-D [M, K] or 3-D [B, S, K]; got shape " + shape_str(a));
  }
  if (b.dim() != 2) return fail(kBadB, "b must be 2-D [K, N]; got shape " + shape_str(b));
  if (a.device() != b.device()) {
    return fail(kDevice,
                "a and b must be on the same device; got a on " + a.device().str() + ", b on " + b.device().str());
  }
  if (a.device().type() != device_type) {
    return fail(kDevice, "this kernel handles " + std::string(c10::DeviceTypeName(device_type, true)) +
                             " tensors; got a on " + a.device().str());
  }
  call.out_dtype = a.scalar_type();
  if (quantization_requested(a, b, quant)) {
    if (auto problem = check_quantization(a, b, quant, call.quant, call.out_dtype)) {
      return fail(static_cast<ErrorCode>(problem->code), problem->message);
    }
  } else {
    if (a.scalar_type() != b.scalar_type()) {
      return fail(kDtype, "a and b must have the same dtype; got a " + std::string(c10::toString(a.scalar_type())) +
                              ", b " + std::string(c10::toString(b.scalar_type())));
    }
    bool supported = false;
    for (auto d : supported_dtypes) supported = supported || d == a.scalar_type();
    if (!supported) {
      return fail(kDtype, "a has dtype " + std::string(c10::toString(a.scalar_type())) + "; supported on " +
                              a.device().str() + ": " + dtype_list(supported_dtypes));
    }
  }
  if (a.size(-1) != b.size(0)) {
    return fail(kKMismatch, "a has K=" + std::to_string(a.size(-1)) + " (last dim of " + shape_str(a) +
                                ") but b has K=" + std::to_string(b.size(0)) + " (first dim of " + shape_str(b) + ")");
  }
  const int64_t n = b.size(1);
  if (bias.has_value() && bias->defined()) {
    const at::Tensor& c = *bias;
    if (c.dim() != 1 || c.size(0) != n) {
      return fail(kBadBias, "bias must be 1-D [N] with N=" + std::to_string(n) + "; got shape " + shape_str(c));
    }
    if (c.scalar_type() != call.out_dtype) {
      const std::string of = call.out_dtype == a.scalar_type() ? "a" : "the result (out_dtype)";
      return fail(kDtype, "bias must have the dtype of " + of + " (" + std::string(c10::toString(call.out_dtype)) +
                              "); got " + std::string(c10::toString(c.scalar_type())));
    }
    if (c.device() != a.device()) {
      return fail(kDevice, "bias must be on the device of a (" + a.device().str() + "); got " + c.device().str());
    }
    call.bias = c;
  }
  call.k = a.size(-1);
  call.n = n;
  call.m = a.numel() / std::max<int64_t>(call.k, 1);
  if (call.k == 0) call.m = a.dim() == 2 ? a.size(0) : a.size(0) * a.size(1);
  call.a2d = a.reshape({call.m, call.k});
  call.b = b;
  call.dtype = a.scalar_type();
  call.out_shape.assign(a.sizes().begin(), a.sizes().end() - 1);
  call.out_shape.push_back(n);
  return call;
}

}  // namespace gemm_ar
