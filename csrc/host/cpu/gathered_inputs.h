// gemm_allreduce's gathered-inputs flow on the CPU engine, for outputs much larger than the inputs. The usual flow
// moves partial products: every rank writes the peers' rows of its partial into its window, and each owner reads them
// back to reduce (two passes over the output's size per rank, on top of the all-gather). Here every rank publishes its
// inputs instead (a, [M, K], and b, [K, N]), and each owner multiplies its rows once by every rank's K (sum_r a_r[rows]
// @ b_r = [a_0 | a_1 | ...][rows] @ [b_0; b_1; ...]), then all-gathers them as usual. Worth it only where the inputs
// are much smaller than the output, so that publishing them costs clearly less than the passes over the output it
// saves (docs/journal/performance-journal.md). One core per rank only (the owner-last walk, owner_last_compute.cpp);
// `auto` times it (Algorithm::FusedGatheredInputs), no geometry rule takes it.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

#include "cpu/fused_call.h"

namespace gemm_ar::cpu {

// Whether `auto` should time the flow for a gemm_allreduce of [M, K] x [K, N] in `dtype` on `world` ranks: an output
// of 64K elements or more, inputs at most an eighth of it (K (M + N) <= M N / 8: where the two flows are close, the
// tuner's back-to-back runs and a model's surroundings disagreed), and a dtype the engine multiplies as it is (fp32,
// or bf16/fp16 with the CPU's matrix instructions).
// Also the engine's side: the configuration of the flow takes it (one core per rank, communication between tiles,
// no tile from the environment) and the owner-last walk is on.
bool suits_gathered_inputs(int64_t m, int64_t k, int64_t n, at::ScalarType dtype, int world);

// Copies this rank's a and b into its window (layout.hpp, gathered_a_row_offset and gathered_b_offset); peers read
// them once the walk has published a tile flag of theirs (release order through the ready queue).
void publish_gathered_inputs(const CallJob& job);

// The owner's product of output rows [row0, row0 + rows), columns [col0, col0 + cols): every rank's a rows and b
// columns (this rank's from the call, the peers' from their windows, each peer's tile flag for the tile seen with
// acquire order) multiplied at once, plus the bias, into the output. `a_rows` and `b_cols` are reused scratch.
void multiply_gathered_rows(const CallJob& job, int64_t row0, int64_t rows, int64_t col0, int64_t cols,
                            at::Tensor& a_rows, at::Tensor& b_cols);

// Calls this process ran with the flow (tests: the engine really takes it).
int64_t gathered_inputs_call_count();
void count_gathered_inputs_call();

}  // namespace gemm_ar::cpu
