#include "cpu/engine_options.h"

namespace gemm_ar::cpu {
namespace {

// Booleans take one bit of the signature, fewer_b_reorders (0..2) two.
template <typename T>
constexpr int signature_width() {
  return sizeof(T) == 1 ? 1 : 2;
}

constexpr int signature_bits() {
  int bits = 0;
#define GEMM_AR_ENGINE_OPTION_WIDTH(type, name, initial, what) bits += signature_width<type>();
  GEMM_AR_ENGINE_OPTION_LIST(GEMM_AR_ENGINE_OPTION_WIDTH)
#undef GEMM_AR_ENGINE_OPTION_WIDTH
  return bits;
}
static_assert(signature_bits() <= kEngineOptionSignatureBits, "the engine options outgrew their signature bits");

}  // namespace

EngineOptions& engine_options() {
  static EngineOptions options;
  return options;
}

int64_t engine_options_signature() {
  const EngineOptions& o = engine_options();
  int64_t bits = 0;
  int shift = 0;
#define GEMM_AR_ENGINE_OPTION_BITS(type, name, initial, what)                                  \
  {                                                                                            \
    constexpr int width = signature_width<type>();                                             \
    bits |= (static_cast<int64_t>(option(o.name)) & ((int64_t{1} << width) - 1)) << shift;     \
    shift += width;                                                                            \
  }
  GEMM_AR_ENGINE_OPTION_LIST(GEMM_AR_ENGINE_OPTION_BITS)
#undef GEMM_AR_ENGINE_OPTION_BITS
  return bits;
}

}  // namespace gemm_ar::cpu
