// The emulated runtime's settings, read from the environment when they are used (docs/testing.md, "The emulated
// Ascend runtime", lists them). Text a setting cannot take raises an error naming the variable: a mistyped setting
// would otherwise run the tests under a configuration nobody asked for.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>

namespace gemm_ar::emu::settings {

// The whole number `name` holds (`fallback` when unset), at least `minimum`.
int64_t integer(const char* name, int64_t fallback, int64_t minimum);

// The word `name` holds (`fallback` when unset), one of `allowed`.
std::string word(const char* name, const char* fallback, std::initializer_list<const char*> allowed);

// Reads every setting once: a rank process checks them when it loads the emulator, before any group exists.
void check_all();

// The settings with their defaults, used by the code that reads them and by check_all().
inline int64_t wait_seconds() { return integer("GEMM_AR_EMU_WAIT_S", 120, 1); }
inline int64_t cube_cores() { return integer("GEMM_AR_EMU_CUBE_CORES", 2, 1); }
inline int64_t vector_cores() { return integer("GEMM_AR_EMU_VECTOR_CORES", 4, 1); }
inline int64_t aicore_timeout_ms() { return integer("GEMM_AR_EMU_AICORE_TIMEOUT_MS", 68000, 1); }
// HCCL's own variable (megabytes per window); small by default, since every byte is host memory.
inline int64_t window_megabytes() { return integer("HCCL_BUFFSIZE", 8, 1); }
inline bool zero_windows() { return word("GEMM_AR_EMU_WINDOW_FILL", "random", {"random", "zero"}) == "zero"; }
// Negative control (tests only): the context names the next rank's window this many bytes past where it is.
inline int64_t fault_window_shift() { return integer("GEMM_AR_EMU_FAULT_WINDOW_SHIFT", 0, 0); }

}  // namespace gemm_ar::emu::settings
