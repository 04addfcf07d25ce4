// The CPU engine's GEMM alone, for benchmarks: the question "is the engine's tiled GEMM as fast as one plain GEMM"
// (docs/decisions/0014-cpu-engine-per-call-geometry.md) needs its cost without any communication, which the engine's
// own modes always include.
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace gemm_ar::cpu {

// a @ b (+ bias) multiplied tile by tile as a gemm_allreduce call of the same shape on `world` local ranks does it:
// its geometry and compute blocks (call_config; several blocks run in parallel as in the engine), through B's panels
// when the engine packs them (one compute block), into a fresh output of the compute dtype. No windows, no
// communication.
at::Tensor engine_tile_walk(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias, int world);

}  // namespace gemm_ar::cpu
