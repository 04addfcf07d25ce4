// The CPU engine's GEMM alone, for benchmarks: the question "is the engine's tiled GEMM as fast as one plain GEMM"
// (issue 11, item 1) needs its cost without any communication, which the engine's own modes always include.
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace gemm_ar::cpu {

// a @ b (+ bias) multiplied tile by tile, on this thread, in the geometry a gemm_allreduce call of the same shape on
// `world` local ranks takes (call_config) and through B's panels packed once as the engine packs them, into a fresh
// output of the compute dtype. No windows, no communication.
at::Tensor engine_tile_walk(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                            int world);

}  // namespace gemm_ar::cpu
