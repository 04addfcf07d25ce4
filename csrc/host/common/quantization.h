// Quantized calls (W8A8, W8A16): their argument checks, their place in the call signature and the dequantized fp32
// partial product each rank reduces (docs/decisions/0020-quantized-ops.md).
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

#include "common/call_args.h"

namespace gemm_ar {

// Whether these arguments ask for a quantized call (int8 a or b, a scale, or an out_dtype other than a's dtype): then
// check_quantization decides the call's dtypes, not the plain rule that a and b share one.
bool quantization_requested(const at::Tensor& a, const at::Tensor& b, const QuantInputs& inputs);

struct ArgumentProblem {
  int64_t code;
  std::string message;
};

// Checks a quantized call's dtypes, scales and out_dtype (a and b already 2-D/3-D and 2-D on one device) and fills
// `quant` and `out_dtype`; the problem naming the argument otherwise.
std::optional<ArgumentProblem> check_quantization(const at::Tensor& a, const at::Tensor& b, const QuantInputs& inputs,
                                                  Quantization& quant, at::ScalarType& out_dtype);

bool is_quantized(const CallArgs& call);

// The call's numeric format as one signature word (kSigDtype) and tuning-bucket field: a's dtype alone for a plain
// call (the word it always was), with the scheme, both scale kinds and the out dtype above it for a quantized one.
int64_t numeric_format(const CallArgs& call);
// Readable form of numeric_format's word, for disagreement messages and tune-cache keys.
std::string numeric_format_name(int64_t format);

// out (fp32 [rows, N], unit column stride) = the dequantized product of a's rows [row0, row0 + rows) and b, plus
// the bias (in fp32) when `add_bias`: int8 x int8 into int32 (torch._int_mm) scaled by a_scale and b_scale for W8A8;
// a times b, both converted to fp32, then b_scale per column for W8A16.
void dequantized_product(const CallArgs& call, int64_t row0, int64_t rows, bool add_bias, at::Tensor out);

// How many dequantized products this process has computed (tests: the quantized path really ran).
int64_t dequantized_product_calls();

}  // namespace gemm_ar
