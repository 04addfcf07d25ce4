#include "cpu/reduce_avx512.h"

#include <atomic>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define GEMM_AR_HAS_AVX512_REDUCE 1
#define GEMM_AR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#endif

namespace gemm_ar::cpu {
namespace {

std::atomic<bool>& avx512_reduce_on() {
  static std::atomic<bool> on{true};
  return on;
}

}  // namespace

bool set_avx512_reduce(bool on) { return avx512_reduce_on().exchange(on); }

#ifdef GEMM_AR_HAS_AVX512_REDUCE

bool cpu_has_avx512_reduce() {
  static const bool has =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return has;
}

namespace {

// 16 elements at a time; `mask` covers a row's last, partial vector.
struct F32 {
  using T = float;
  GEMM_AR_AVX512 static __m512 load(const T* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
  GEMM_AR_AVX512 static void store(T* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }
  GEMM_AR_AVX512 static __m512 round(__m512 v) { return v; }  // fp32 sums are stored as they are
};

struct BF16 {
  using T = uint16_t;
  GEMM_AR_AVX512 static __m512 load(const T* p, __mmask16 mask) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  // Round to nearest even on the bits, NaN -> 0x7FC0: element_casts.h's BFloat16Bits::store, 16 lanes at once.
  GEMM_AR_AVX512 static __m256i bits(__m512 v) {
    const __m512i x = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan =
        _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0)));
  }
  GEMM_AR_AVX512 static void store(T* p, __m512 v, __mmask16 mask) { _mm256_mask_storeu_epi16(p, mask, bits(v)); }
  GEMM_AR_AVX512 static __m512 round(__m512 v) {  // the value a bf16 store keeps
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits(v)), 16));
  }
};

// One row: acc = p0 + p1 + ... in rank order; out (and the bank) = acc rounded, or with an addend in out,
// bank = round(acc), out = round(round(acc) + out). Plain stores: the caller publishes the bank afterwards with a
// release store of the subtile's final flag (x86 keeps the order of ordinary stores).
template <class In, class Out>
GEMM_AR_AVX512 void reduce_row(const ReduceRows& job, int64_t row) {
  using InT = typename In::T;
  using OutT = typename Out::T;
  auto* out = reinterpret_cast<OutT*>(job.out) + row * job.out_stride;
  auto* bank = job.bank != nullptr ? reinterpret_cast<OutT*>(job.bank) + row * job.bank_stride : nullptr;
  const int64_t offset = row * job.source_stride;
  for (int64_t c = 0; c < job.cols; c += 16) {
    const int64_t left = job.cols - c;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    __m512 acc = In::load(reinterpret_cast<const InT*>(job.sources[0]) + offset + c, mask);
    for (int r = 1; r < job.world; ++r) {
      acc = _mm512_add_ps(acc, In::load(reinterpret_cast<const InT*>(job.sources[r]) + offset + c, mask));
    }
    if (bank != nullptr) Out::store(bank + c, acc, mask);
    if (job.add_into_out) acc = _mm512_add_ps(Out::round(acc), Out::load(out + c, mask));
    Out::store(out + c, acc, mask);
  }
}

template <class In, class Out>
GEMM_AR_AVX512 void reduce_all_rows(const ReduceRows& job) {
  for (int64_t i = 0; i < job.rows; ++i) reduce_row<In, Out>(job, i);
}

}  // namespace

bool reduce_rows_avx512(const ReduceRows& job) {
  if (!avx512_reduce_on().load(std::memory_order_relaxed) || !cpu_has_avx512_reduce()) return false;
  const auto in = job.partial_dtype, out = job.out_dtype;
  if (in == at::kFloat && out == at::kFloat) return reduce_all_rows<F32, F32>(job), true;
  if (in == at::kFloat && out == at::kBFloat16) return reduce_all_rows<F32, BF16>(job), true;
  if (in == at::kBFloat16 && out == at::kBFloat16) return reduce_all_rows<BF16, BF16>(job), true;
  return false;
}

#else  // not x86-64 GCC/Clang: the portable loop only

bool cpu_has_avx512_reduce() { return false; }
bool reduce_rows_avx512(const ReduceRows&) { return false; }

#endif

}  // namespace gemm_ar::cpu
