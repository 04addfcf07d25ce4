// GEMM_AR_FN: the qualifier every protocol function carries, so one header serves the host compiler (g++),
// the AICore compiler (bisheng) and pto-isa's CPU simulator (g++ with -D__CPU_SIM).
#pragma once

#if !defined(GEMM_AR_FN)
#if defined(__aicore__)
// bisheng, or the simulator after pto/pto-inst.hpp (whose cpu_stub.hpp defines __aicore__ as nothing).
#define GEMM_AR_FN __aicore__ inline
#elif (defined(__CCE_AICORE__) || defined(__CCE__)) && !defined(__CPU_SIM) && !defined(__CCE_KT_TEST__)
// bisheng without the macro in scope: spell the attribute the way pto-isa's AICORE does.
#define GEMM_AR_FN [aicore] inline
#else
// Host g++, or the simulator before pto/pto-inst.hpp: there __aicore__ will expand to nothing anyway, so plain
// inline is the same thing and keeps the header independent of include order.
#define GEMM_AR_FN inline
#endif
#endif
