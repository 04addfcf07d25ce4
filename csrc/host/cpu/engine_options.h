// The CPU engine's options: real A/B choices between data flows and tile geometries, kept so that benchmarks and
// tests can compare them. Process-wide; they change how a call uses the windows, so they are part of the call
// signature every rank agrees on (engine_options_signature). One list, from which the struct, the signature and
// the Python bindings (_C._engine_options, _C._set_engine_option) follow.
#pragma once
#include <atomic>
#include <cstdint>

// X(type, name, default, largest value, what turning it away from the default does)
#define GEMM_AR_ENGINE_OPTION_LIST(X)                                                                               \
  X(bool, overlap, true, 1,                                                                                         \
    "False: comm starts after the whole GEMM (the \"sequential (same engine)\" benchmark row)")                     \
  X(bool, owner_last, true, 1,                                                                                      \
    "False: on one core per rank the owner reduces in its comm block, as with comm threads")                        \
  X(bool, row_epilogue_geometry, true, 1, "False: add+RMSNorm calls keep the engine's default tile geometry")       \
  X(bool, wide_row_panels, true, 1,                                                                                 \
    "False: gemm_allreduce and gemm_reduce_scatter keep the default tile geometry on one-core ranks")               \
  X(bool, packed_b, true, 1, "False: tiles multiply through at::mm even where B's panels could be packed once")     \
  X(int64_t, fewer_b_reorders, 1, 2,                                                                                \
    "calls on one-core ranks taking the fewer-tile-row geometries: 1 those whose products reorder B per call and "  \
    "long-K gemm_allreduce calls, 0 none, 2 every call")                                                            \
  X(bool, one_shot, true, 1, "False: small gemm_allreduce calls reduce-scatter and all-gather instead of one shot") \
  X(bool, one_product, true, 1, "False: calls whose geometry asks for one GEMM per call multiply tile by tile")     \
  X(bool, tune_tile_family, true, 1, "False: `auto` races fused only with the geometry rules' tiles")               \
  X(bool, tune_gathered_inputs, true, 1, "False: `auto` does not time the gathered-inputs flow")                    \
  X(bool, decode, true, 1, "False: decode-sized gemm_allreduce calls (M <= 64) keep the other geometries")

namespace gemm_ar::cpu {

// Set between calls by benchmarks and tests, read at each call: relaxed (the caller orders them by its calls).
struct EngineOptions {
#define GEMM_AR_ENGINE_OPTION_FIELD(type, name, initial, largest, what) std::atomic<type> name{initial};
  GEMM_AR_ENGINE_OPTION_LIST(GEMM_AR_ENGINE_OPTION_FIELD)
#undef GEMM_AR_ENGINE_OPTION_FIELD
};
EngineOptions& engine_options();

// Reads an option (relaxed: see EngineOptions).
template <typename T>
T option(const std::atomic<T>& field) {
  return field.load(std::memory_order_relaxed);
}

// Every option, in as many bits as its largest value needs, for the call signature: at most this many bits.
constexpr int kEngineOptionSignatureBits = 16;
int64_t engine_options_signature();

}  // namespace gemm_ar::cpu
