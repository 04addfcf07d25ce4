#include "cpu/engine_options.h"

namespace gemm_ar::cpu {
namespace {

// Bits of the signature an option with values 0..largest takes.
constexpr int signature_width(int64_t largest) {
  int bits = 1;
  while ((int64_t{1} << bits) <= largest) ++bits;
  return bits;
}

constexpr int signature_bits() {
  int bits = 0;
#define GEMM_AR_ENGINE_OPTION_WIDTH(type, name, initial, largest, what) bits += signature_width(largest);
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
#define GEMM_AR_ENGINE_OPTION_BITS(type, name, initial, largest, what)                     \
  {                                                                                        \
    constexpr int width = signature_width(largest);                                        \
    bits |= (static_cast<int64_t>(option(o.name)) & ((int64_t{1} << width) - 1)) << shift; \
    shift += width;                                                                        \
  }
  GEMM_AR_ENGINE_OPTION_LIST(GEMM_AR_ENGINE_OPTION_BITS)
#undef GEMM_AR_ENGINE_OPTION_BITS
  return bits;
}

}  // namespace gemm_ar::cpu
