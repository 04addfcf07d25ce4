#include "common/quantization.h"

#include <atomic>
#include <sstream>

namespace gemm_ar {
namespace {

std::atomic<int64_t> products_computed{0};

constexpr int64_t kFormatOutShift = 8, kFormatSchemeShift = 16, kFormatAScaleShift = 20, kFormatBScaleShift = 24;
constexpr int64_t kFormatByte = 0xFF, kFormatNibble = 0xF;

std::string dtype_name(at::ScalarType dtype) {
  return dtype == at::kChar ? std::string("int8") : std::string(c10::toString(dtype));
}

std::string shape_of(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

bool float_dtype(at::ScalarType dtype) { return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf; }

const char* scale_kind_name(int64_t kind, bool of_a) {
  switch (static_cast<ScaleKind>(kind)) {
    case ScaleKind::kPerTensor: return "one-value";
    case ScaleKind::kPerRow: return of_a ? "per-token" : "per-channel";
    case ScaleKind::kNone: break;
  }
  return "none";
}

// A scale's common checks: fp32, on a's device. `what` names the argument.
std::optional<ArgumentProblem> check_scale_tensor(const at::Tensor& scale, const at::Tensor& a, int64_t code,
                                                  const char* what) {
  if (scale.scalar_type() != at::kFloat) {
    return ArgumentProblem{code, std::string(what) + " must be float32; got " + dtype_name(scale.scalar_type())};
  }
  if (scale.device() != a.device()) {
    return ArgumentProblem{code, std::string(what) + " must be on the device of a (" + a.device().str() + "); got " +
                                     scale.device().str()};
  }
  return std::nullopt;
}

// An operand the int8 kernels read correctly: a fresh row-major copy where a dim has size 1 (torch._int_mm read a
// [1, N] view with strides (1, 1) wrongly, and `contiguous()` returns such views unchanged), else `t` itself, whose
// strides the kernels take as they are (b = w.t() is not copied).
at::Tensor plain_strides(const at::Tensor& t) {
  return t.size(0) == 1 || t.size(1) == 1 ? t.clone(at::MemoryFormat::Contiguous) : t;
}

}  // namespace

bool quantization_requested(const at::Tensor& a, const at::Tensor& b, const QuantInputs& inputs) {
  const bool scale_given = (inputs.a_scale.has_value() && inputs.a_scale->defined()) ||
                           (inputs.b_scale.has_value() && inputs.b_scale->defined());
  const bool other_out = inputs.out_dtype.has_value() && *inputs.out_dtype != a.scalar_type();
  return a.scalar_type() == at::kChar || b.scalar_type() == at::kChar || scale_given || other_out;
}

std::optional<ArgumentProblem> check_quantization(const at::Tensor& a, const at::Tensor& b, const QuantInputs& inputs,
                                                  Quantization& quant, at::ScalarType& out_dtype) {
  const bool a_int8 = a.scalar_type() == at::kChar, b_int8 = b.scalar_type() == at::kChar;
  const bool has_a_scale = inputs.a_scale.has_value() && inputs.a_scale->defined();
  const bool has_b_scale = inputs.b_scale.has_value() && inputs.b_scale->defined();
  if (a_int8 && !b_int8) {
    return ArgumentProblem{kQuantizedDtypesError,
                           "a is int8 (W8A8), so b must be int8 too; got b " + dtype_name(b.scalar_type())};
  }
  if (!b_int8) {  // no int8 operand: a scale or out_dtype given to a plain call
    const std::string dtypes = "a is " + dtype_name(a.scalar_type()) + ", b is " + dtype_name(b.scalar_type());
    if (has_a_scale) {
      return ArgumentProblem{kBadAScaleError, "a_scale is only for int8 a and b (W8A8); " + dtypes};
    }
    if (has_b_scale) return ArgumentProblem{kBadBScaleError, "b_scale is only for int8 b (W8A8, W8A16); " + dtypes};
    return ArgumentProblem{kBadOutDtypeError,
                           "out_dtype is only for quantized calls (int8 b); a plain call returns "
                           "a's dtype " +
                               dtype_name(a.scalar_type()) + ", got out_dtype=" + dtype_name(*inputs.out_dtype)};
  }
  if (!a_int8 && !float_dtype(a.scalar_type())) {
    return ArgumentProblem{kQuantizedDtypesError,
                           "b is int8, so a must be int8 (W8A8) or float32, bfloat16 or "
                           "float16 (W8A16); got a " +
                               dtype_name(a.scalar_type())};
  }
  quant.scheme = a_int8 ? QuantScheme::kW8A8 : QuantScheme::kW8A16;
  const int64_t n = b.size(1);
  if (!has_b_scale) {
    return ArgumentProblem{kBadBScaleError, "b is int8, so b_scale is required: float32 [N] (per output channel, N=" +
                                                std::to_string(n) + ") or one value"};
  }
  const at::Tensor& b_scale = *inputs.b_scale;
  if (auto problem = check_scale_tensor(b_scale, a, kBadBScaleError, "b_scale")) return problem;
  if (b_scale.numel() == 1) {
    quant.b_scale_kind = ScaleKind::kPerTensor;
  } else if (b_scale.dim() == 1 && b_scale.size(0) == n) {
    quant.b_scale_kind = ScaleKind::kPerRow;
  } else {
    return ArgumentProblem{kBadBScaleError, "b_scale must be [N] (per output channel, N=" + std::to_string(n) +
                                                ") or one value; got shape " + shape_of(b_scale)};
  }
  quant.b_scale = b_scale.reshape({-1});
  if (a_int8) {
    const std::vector<int64_t> tokens(a.sizes().begin(), a.sizes().end() - 1);
    std::vector<int64_t> tokens_by_one = tokens;
    tokens_by_one.push_back(1);
    std::ostringstream expected;
    expected << c10::IntArrayRef(tokens);
    if (!has_a_scale) {
      return ArgumentProblem{kBadAScaleError, "a is int8, so a_scale is required: float32 of a's leading shape " +
                                                  expected.str() + " (per token) or one value"};
    }
    const at::Tensor& a_scale = *inputs.a_scale;
    if (auto problem = check_scale_tensor(a_scale, a, kBadAScaleError, "a_scale")) return problem;
    if (a_scale.numel() == 1) {
      quant.a_scale_kind = ScaleKind::kPerTensor;
    } else if (a_scale.sizes() == c10::IntArrayRef(tokens) || a_scale.sizes() == c10::IntArrayRef(tokens_by_one)) {
      quant.a_scale_kind = ScaleKind::kPerRow;
    } else {
      return ArgumentProblem{kBadAScaleError, "a_scale must have a's leading shape " + expected.str() +
                                                  " (per token) or be one value; got shape " + shape_of(a_scale)};
    }
    quant.a_scale = a_scale.reshape({-1});
  } else if (has_a_scale) {
    return ArgumentProblem{kBadAScaleError, "a_scale is only for int8 a (W8A8); a is " + dtype_name(a.scalar_type()) +
                                                " (W8A16 takes b_scale only)"};
  }
  out_dtype = inputs.out_dtype.value_or(a_int8 ? at::kBFloat16 : a.scalar_type());
  if (!float_dtype(out_dtype)) {
    return ArgumentProblem{kBadOutDtypeError,
                           "out_dtype must be float32, bfloat16 or float16; got " + dtype_name(out_dtype)};
  }
  return std::nullopt;
}

bool is_quantized(const CallArgs& call) { return call.quant.scheme != QuantScheme::kNone; }

int64_t numeric_format(const CallArgs& call) {
  const auto dtype = static_cast<int64_t>(call.dtype);
  if (!is_quantized(call)) return dtype;
  return dtype | (static_cast<int64_t>(call.out_dtype) + 1) << kFormatOutShift |
         static_cast<int64_t>(call.quant.scheme) << kFormatSchemeShift |
         static_cast<int64_t>(call.quant.a_scale_kind) << kFormatAScaleShift |
         static_cast<int64_t>(call.quant.b_scale_kind) << kFormatBScaleShift;
}

std::string numeric_format_name(int64_t format) {
  const auto dtype = static_cast<at::ScalarType>(format & kFormatByte);
  const int64_t scheme = (format >> kFormatSchemeShift) & kFormatNibble;
  if (scheme == 0) return c10::toString(dtype);
  std::ostringstream os;
  // No spaces or semicolons: the name is also a field of the tune cache's keys.
  os << (scheme == static_cast<int64_t>(QuantScheme::kW8A8) ? "W8A8" : "W8A16") << "(a=" << dtype_name(dtype)
     << ",out=" << dtype_name(static_cast<at::ScalarType>(((format >> kFormatOutShift) & kFormatByte) - 1));
  if (scheme == static_cast<int64_t>(QuantScheme::kW8A8)) {
    os << ",a_scale=" << scale_kind_name((format >> kFormatAScaleShift) & kFormatNibble, /*of_a=*/true);
  }
  os << ",b_scale=" << scale_kind_name((format >> kFormatBScaleShift) & kFormatNibble, /*of_a=*/false) << ")";
  return os.str();
}

void dequantized_product(const CallArgs& call, int64_t row0, int64_t rows, bool add_bias, at::Tensor out) {
  products_computed.fetch_add(1, std::memory_order_relaxed);  // a statistic for tests only: no ordering needed
  if (rows == 0 || call.n == 0) return;
  const Quantization& q = call.quant;
  if (call.k == 0) {
    out.zero_();
  } else if (q.scheme == QuantScheme::kW8A8) {
    at::Tensor a_rows = plain_strides(call.a2d.narrow(0, row0, rows).contiguous());
    at::Tensor acc = at::_int_mm(a_rows, plain_strides(call.b));  // int32, exact
    out.copy_(acc);
    // a_scale * acc * b_scale, in this order (the op's formula, docs/usage.md).
    out.mul_(q.a_scale_kind == ScaleKind::kPerRow ? q.a_scale.narrow(0, row0, rows).unsqueeze(1) : q.a_scale);
    out.mul_(q.b_scale);
  } else {
    // fp32 BLAS on b converted exactly (int8 values are exact in fp32), then b_scale per column: aten's W8A16 kernel
    // (_weight_int8pack_mm) is far slower in fp32 and rounds the partial in its half-precision variants
    // (docs/decisions/0020-quantized-ops.md). b keeps its strides: w.t() stays a transposed view for BLAS.
    at::mm_out(out, plain_strides(call.a2d.narrow(0, row0, rows).to(at::kFloat)), plain_strides(call.b.to(at::kFloat)));
    out.mul_(q.b_scale);
  }
  if (add_bias && call.bias.has_value()) out.add_(call.bias->to(at::kFloat));
}

int64_t dequantized_product_calls() { return products_computed.load(std::memory_order_relaxed); }

}  // namespace gemm_ar
