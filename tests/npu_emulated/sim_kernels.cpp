// Compiled with the simulator's flags (tests/kernel_sim_build.py), linked into the emulated runtime.
#include "sim_kernels.h"

#include <pto/pto-inst.hpp>

#include <thread>
#include <type_traits>
#include <vector>

#include "kernel_entry.h"
#include "sim_data_cache.hpp"
#include "sp_kernel_entry.h"

namespace gemm_ar::emu::sim {

namespace cache = gemm_ar::device::sim_cache;

struct Core {
  cache::CoreCache cache;
};

Core* new_core() { return new Core(); }

bool on_cube_cores(int kernel) { return kernel == kGemmCompute || kernel == kRsCompute || kernel == kAgCompute; }

namespace {

using Entry = void (*)(__gm__ uint8_t*);

Entry entry_of(int kernel) {
  switch (kernel) {
    case kGemmCompute: return &GemmComputeKernel;
    case kGemmComm: return &GemmCommKernel;
    case kRsCompute: return &GemmRsComputeKernel;
    case kRsComm: return &GemmRsCommKernel;
    case kAgCompute: return &AgGemmComputeKernel;
    case kAgComm: return &AgGemmCommKernel;
    default: return nullptr;
  }
}

}  // namespace

void run_kernel(int kernel, uint32_t blocks, Core* const* cores, void* args_device) {
  const Entry entry = entry_of(kernel);
  std::vector<std::thread> threads;
  threads.reserve(blocks);
  for (uint32_t b = 0; b < blocks; ++b) {
    Core* core = cores[b];
    threads.emplace_back([entry, b, core, args_device]() {
      pto::cpu_sim::set_execution_context(b, 0, 1);
      cache::bind_core(&core->cache);
      entry(static_cast<__gm__ uint8_t*>(args_device));
      core->cache.retire_dirty();  // stores the kernel never published are lost; the lines stay cached
      cache::bind_core(nullptr);
    });
  }
  for (auto& t : threads) t.join();
}

ModelCounters model_counters() {
  return {cache::lost_store_lines().load(), cache::unfenced_flags().load(), cache::unfenced_accesses().load(),
          cache::sync_waits_without_set().load(), cache::sync_sets_unwaited().load()};
}

bool bf16_native() { return !std::is_same<bfloat16_t, half>::value; }

}  // namespace gemm_ar::emu::sim
