#include "cpu/gathered_inputs.h"

#include <gemm_ar/layout.hpp>

#include <atomic>

#include "common/call_args.h"
#include "common/local_gemm.h"
#include "cpu/call_geometry.h"

namespace gemm_ar::cpu {
namespace {

std::atomic<int64_t> gathered_calls{0};

// Peer r's a ([M, K]) or b ([K, N]) as published in its window.
at::Tensor peer_a(const CallJob& job, int r) {
  const TilePlan& p = job.plan;
  return at::from_blob(job.region(r, gathered_a_row_offset(job.layout, 0, p.k, job.partial_elem)), {p.m, p.k},
                       at::TensorOptions().dtype(job.partial_dtype));
}
at::Tensor peer_b(const CallJob& job, int r) {
  const TilePlan& p = job.plan;
  return at::from_blob(job.region(r, gathered_b_offset(job.layout, p.m, p.k, job.partial_elem)), {p.k, p.n},
                       at::TensorOptions().dtype(job.partial_dtype));
}

// Rank 0's bias as published in its window (every owner adds it to its rows: the sum holds it once).
at::Tensor rank0_bias(const CallJob& job) {
  const TilePlan& p = job.plan;
  return at::from_blob(job.region(0, gathered_bias_offset(job.layout, p.m, p.k, p.n, job.partial_elem)), {p.n},
                       at::TensorOptions().dtype(job.partial_dtype));
}

}  // namespace

bool suits_gathered_inputs(int64_t m, int64_t k, int64_t n, at::ScalarType dtype, int world) {
  const bool as_is = dtype == at::kFloat || reorders_b_per_product(dtype);
  if (!as_is || world < 2 || m <= 0 || n <= 0 || k < 0 || m * n < 65536 || 8 * k * (m + n) > m * n) return false;
  // As FusedEngine::run sets CallJob::gathered_inputs (the call's own conditions hold for a gemm_allreduce).
  const EngineOptions& options = engine_options();
  return call_config(kOpGemmAllreduce, m, k, n, dtype, world, 3).gathered_inputs && option(options.owner_last) &&
         option(options.overlap);
}

void publish_gathered_inputs(const CallJob& job) {
  // The call's own tensors (any strides) into the window's row-major copies; release order comes with the tile
  // flags the walk publishes afterwards.
  peer_a(job, job.rank).copy_(job.call->a2d);
  peer_b(job, job.rank).copy_(job.call->b);
  if (job.rank == 0 && job.call->bias.has_value()) rank0_bias(job).copy_(*job.call->bias);
}

void multiply_gathered_rows(const CallJob& job, int64_t row0, int64_t rows, int64_t col0, int64_t cols,
                            at::Tensor& a_rows, at::Tensor& b_cols) {
  const TilePlan& p = job.plan;
  const int64_t k = p.k, wk = job.world * k;
  const auto options = at::TensorOptions().dtype(job.partial_dtype);
  if (!a_rows.defined() || a_rows.numel() < rows * wk) a_rows = at::empty({rows * wk}, options);
  if (!b_cols.defined() || b_cols.numel() < wk * cols) b_cols = at::empty({wk * cols}, options);
  at::Tensor a_cat = a_rows.narrow(0, 0, rows * wk).view({rows, wk});
  at::Tensor b_cat = b_cols.narrow(0, 0, wk * cols).view({wk, cols});
  for (int r = 0; r < job.world; ++r) {
    // This rank's rows straight from the call; the peers' from their windows (published before their tile flag).
    const at::Tensor a_r = r == job.rank ? job.call->a2d : peer_a(job, r);
    const at::Tensor b_r = r == job.rank ? job.call->b : peer_b(job, r);
    a_cat.narrow(1, r * k, k).copy_(a_r.narrow(0, row0, rows));
    b_cat.narrow(0, r * k, k).copy_(b_r.narrow(1, col0, cols));
  }
  at::Tensor out = at::from_blob(job.out + (row0 * p.n + col0) * job.out_elem, {rows, cols}, {p.n, 1},
                                 at::TensorOptions().dtype(job.out_dtype));
  // Every owner adds rank 0's bias to its own rows (the other flows add rank 0's once, to its partial).
  if (job.call->bias.has_value()) {
    const at::Tensor bias = job.rank == 0 ? *job.call->bias : rank0_bias(job);
    at::addmm_out(out, bias.narrow(0, col0, cols), a_cat, b_cat);
  } else {
    at::mm_out(out, a_cat, b_cat);
  }
}

int64_t gathered_inputs_call_count() { return gathered_calls.load(std::memory_order_relaxed); }
void count_gathered_inputs_call() { gathered_calls.fetch_add(1, std::memory_order_relaxed); }

}  // namespace gemm_ar::cpu
