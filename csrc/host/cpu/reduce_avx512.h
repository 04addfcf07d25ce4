// The owner's reduction (reduce_rows) for fp32 and bf16 written with AVX-512 intrinsics. GCC's vectorisation of the
// portable loop (tile_kernels.cpp) keeps 256-bit vectors, goes through an accumulator buffer and copies the bank
// from the output afterwards, so it is clearly slower than this loop (docs/journal/performance-journal.md), and the
// reduction is most of the communication time of a one-core rank.
#pragma once
#include "cpu/tile_kernels.h"

namespace gemm_ar::cpu {

// Runs `job` where this CPU has AVX-512 F/BW/VL, the loop is switched on, and the partials are fp32 or bf16 with
// an fp32 or bf16 output (fp32 partials into bf16 included); returns false, having done nothing, otherwise. The
// result is bitwise that of the portable loop: the same fp32 additions in rank order and the same round-to-nearest-
// even (NaN -> 0x7FC0) as element_casts.h. Only a NaN in an fp32 output may carry another NaN's payload (x86 keeps
// the first operand's, and compilers may swap the operands of an addition).
bool reduce_rows_avx512(const ReduceRows& job);

// Whether reduce_rows_avx512 can run on this CPU.
bool cpu_has_avx512_reduce();

// Switches the AVX-512 loop on or off (tests compare it with the portable loop); returns the old value.
bool set_avx512_reduce(bool on);

}  // namespace gemm_ar::cpu
