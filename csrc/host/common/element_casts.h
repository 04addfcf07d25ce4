// Element conversions of the CPU row loops (the engine's reduction and copy-out, the add+RMSNorm epilogue): plain
// casts, or for bf16 the same round-to-nearest-even as c10::BFloat16 (NaN -> 0x7FC0) written without branches, so
// that the loops vectorise. c10's conversion tests NaN with a float compare, which compiles to a branch and keeps
// a loop scalar (docs/journal/performance-journal.md).
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

// The wheel is built for any x86-64, so the row loops are also compiled for AVX2 and AVX-512 and picked at run
// time (GCC function multi-versioning). The build has -ffp-contract=off: no FMA contraction, so every version
// rounds alike and ranks on different CPUs still agree bitwise. Templates called from a cloned function must be
// inlined into it (GEMM_AR_INLINE) to get its instruction set.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define GEMM_AR_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define GEMM_AR_VECTOR_CLONES
#endif
#define GEMM_AR_INLINE inline __attribute__((always_inline))

namespace gemm_ar {

template <class T, class Acc>
struct Casts {
  static Acc load(T v) { return static_cast<Acc>(v); }
  static T store(Acc v) { return static_cast<T>(v); }
};

struct BFloat16Bits {
  static float load(at::BFloat16 v) {
    const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  static at::BFloat16 store(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t nan = static_cast<uint32_t>((bits & 0x7FFFFFFFu) > 0x7F800000u);  // on the bits: no branch
    return at::BFloat16(static_cast<uint16_t>(rounded ^ ((rounded ^ 0x7FC0u) & (0u - nan))), at::BFloat16::from_bits());
  }
};

// The branch-free conversions for bf16 with an fp32 accumulator, plain casts otherwise.
template <class T, class Acc>
using FastCasts =
    std::conditional_t<std::is_same_v<T, at::BFloat16> && std::is_same_v<Acc, float>, BFloat16Bits, Casts<T, Acc>>;

}  // namespace gemm_ar
