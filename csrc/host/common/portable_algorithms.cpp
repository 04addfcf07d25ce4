#include "common/portable_algorithms.h"

#include <atomic>
#include <optional>

#include "common/local_gemm.h"
#include "common/quantization.h"
#include "common/rank_agreement.h"
#include "common/settings.h"

namespace gemm_ar {
namespace {

std::atomic<int64_t> partials_computed{0};

// The all_reduce moves the call dtype, as the user's matmul + all_reduce would (fp32 partials of a half-precision
// call would move twice the bytes and fall behind the torch baseline).
c10::intrusive_ptr<c10d::Work> start_allreduce(c10d::ProcessGroup& group, const at::Tensor& t) {
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions options;
  options.timeout = wait_timeout();
  return group.allreduce(tensors, options);
}

// A quantized call's fp32 sum is rounded to its out dtype once, after the reduction.
at::Tensor finish(const CallArgs& call, const at::Tensor& out2d) {
  return out2d.to(call.out_dtype).view(call.out_shape);
}

// The rank's [M, N] partial of a quantized call: dequantized to fp32 before any exchange.
at::Tensor quantized_partial(const CallArgs& call, bool add_bias) {
  auto out = at::empty({call.m, call.n}, call.b.options().dtype(at::kFloat));
  dequantized_product(call, 0, call.m, add_bias, out);
  return out;
}

}  // namespace

at::Tensor run_local(const CallArgs& call) {
  if (is_quantized(call)) return finish(call, quantized_partial(call, /*add_bias=*/true));
  LocalGemm gemm(call.a2d, call.b, call.bias, /*add_bias=*/true);
  auto out = at::empty({call.m, call.n}, call.b.options());
  gemm.compute(0, call.m, 0, call.n, out);
  return out.view(call.out_shape);
}

int64_t sequential_partial_calls() { return partials_computed.load(std::memory_order_relaxed); }

at::Tensor sequential_partial(const CallArgs& call, int rank) {
  partials_computed.fetch_add(1, std::memory_order_relaxed);
  if (is_quantized(call)) return quantized_partial(call, /*add_bias=*/rank == 0);
  LocalGemm gemm(call.a2d, call.b, call.bias, /*add_bias=*/rank == 0);
  auto out = at::empty({call.m, call.n}, call.b.options());
  gemm.compute(0, call.m, 0, call.n, out);
  return out;
}

void carry_result_on_agreement(CallArgs& call, Algorithm chosen, int rank, AgreementPayload& payload) {
  const int64_t elements = call.m * call.n;
  if (chosen != Algorithm::Sequential || !call.error.empty() || call.tune_step >= 0 || !call.b.device().is_cpu() ||
      call.dtype == at::kDouble || elements == 0 || elements > kAgreementPayloadSlots) {
    return;  // fp64 is left out: its sum in fp32 would lose precision
  }
  payload.data = sequential_partial(call, rank).to(at::kFloat);
  call.payload = &payload;
}

at::Tensor run_sequential(const CallArgs& call, c10d::ProcessGroup& group) {
  auto out = sequential_partial(call, group.getRank());
  if (out.numel() > 0) start_allreduce(group, out)->wait(wait_timeout());
  return finish(call, out);
}

at::Tensor run_chunked(const CallArgs& call, c10d::ProcessGroup& group, int64_t chunks) {
  const bool quantized = is_quantized(call);
  const bool add_bias = group.getRank() == 0;
  std::optional<LocalGemm> gemm;
  if (!quantized) gemm.emplace(call.a2d, call.b, call.bias, add_bias);
  auto out = at::empty({call.m, call.n}, call.b.options().dtype(quantized ? at::kFloat : call.dtype));
  const int64_t rows_per_chunk = std::max<int64_t>(1, (call.m + chunks - 1) / std::max<int64_t>(chunks, 1));
  std::vector<c10::intrusive_ptr<c10d::Work>> in_flight;
  for (int64_t row0 = 0; row0 < call.m; row0 += rows_per_chunk) {
    const int64_t rows = std::min(rows_per_chunk, call.m - row0);
    auto slice = out.narrow(0, row0, rows);  // contiguous: whole rows of a row-major buffer
    if (quantized) {
      dequantized_product(call, row0, rows, add_bias, slice);
    } else {
      gemm->compute(row0, rows, 0, call.n, slice);
    }
    if (slice.numel() > 0) in_flight.push_back(start_allreduce(group, slice));
  }
  for (auto& work : in_flight) work->wait(wait_timeout());
  return finish(call, out);
}

}  // namespace gemm_ar
