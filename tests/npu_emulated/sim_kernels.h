// The bridge between the emulated runtime (C++17, torch) and the strict simulator's kernels (C++20, pto-isa's CPU
// simulator, compiled with tests/kernel_sim_build.py's flags): plain types only, so that each side compiles with
// its own flags.
#pragma once
#include <cstdint>

namespace gemm_ar::emu::sim {

// The simulator's kernels, in the order of npu::Kernel (device_runtime.h).
enum KernelId : int { kGemmCompute, kGemmComm, kRsCompute, kRsComm, kAgCompute, kAgComm, kKernelCount };

// Whether the kernel runs on cube cores (the compute kernels) or vector cores (the comm kernels).
bool on_cube_cores(int kernel);

// One simulated core's data cache (sim_data_cache.hpp); kept for the process's lifetime, so that lines outlive a
// kernel as on the device.
struct Core;
Core* new_core();

// Runs `kernel` as a launch of `blocks` blocks, block b on cores[b] (each a thread with its block index set, as
// tests/kernels_sim/sim_main.cpp launches), and returns when every block returned.
void run_kernel(int kernel, uint32_t blocks, Core* const* cores, void* args_device);

// What the cache and ordering model counted in this process so far (sim_data_cache.hpp): stores no write-back
// published, flags raised after unfenced payload stores, flag-guarded accesses with no acquire fence.
struct ModelCounters {
  uint64_t lost_store_lines, unfenced_flags, unfenced_accesses, sync_waits_without_set, sync_sets_unwaited;
};
ModelCounters model_counters();

// Whether the simulator stores bfloat16 natively (g++ >= 13) rather than as a 16-bit IEEE half.
bool bf16_native();

}  // namespace gemm_ar::emu::sim
