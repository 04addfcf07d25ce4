// Simulator builds only (-D__CPU_SIM): a strict model of the AICore scalar data cache in front of GM, so the CPU
// simulator sees what the hardware sees (design.md §8). pto-isa's simulator has coherent memory and no-op dcci;
// here every simulated core (one block thread) keeps its own cache of 64-byte lines:
//  - a scalar load fills the line from memory once and then returns that copy, however stale, until a dcci drops it;
//  - a scalar store goes into the line (write-allocate) and stays invisible to every other core until a dcci
//    covering the stored bytes writes them back;
//  - a dcci of a dirty line writes back every byte it covers as this core last saw it, stale bytes it never stored
//    included (the line is the unit of write-back), so a stale copy can overwrite what others wrote meanwhile;
//  - dcci(p, SINGLE_CACHE_LINE) covers p up to the next 64-byte boundary only (AscendC's documented behaviour
//    for an unaligned address): bytes below p in the same line are neither written back nor refreshed;
//  - no eviction: a store that no dcci ever covers is never seen. Such lines are counted when the core's kernel
//    ends (lost_store_lines()), and the simulator test expects zero;
//  - lines outlive the kernel: the harness binds each simulated core to one CoreCache for the whole run
//    (bind_core), so the next launch on that core starts with whatever the last one left cached, as on hardware.
// Tile copies (TLOAD/TSTORE, atomic adds) bypass this cache, as the DMA engines do on the device.
// Write-backs are relaxed byte stores after a release fence and fills relaxed byte loads before an acquire fence,
// so C++ orders the payload (written by the tile copies) before a flag exactly where the kernel flushes it.
#pragma once
#if !defined(__CPU_SIM)
#error "sim_data_cache.hpp is for the CPU simulator only"
#endif

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

namespace gemm_ar {
namespace device {
namespace sim_cache {

constexpr uint64_t kLineBytes = 64;

struct Line {
  uint8_t bytes[kLineBytes];
  uint64_t dirty = 0;  // bit i: byte i stored by this core and not yet written back
};

// Dirty lines dropped at thread exit over the whole process: stores no dcci ever published.
inline std::atomic<uint64_t>& lost_store_lines() {
  static std::atomic<uint64_t> lost{0};
  return lost;
}

struct CoreCache {
  std::unordered_map<uint64_t, Line> lines;
  // End of a kernel on this core: stores still dirty were never published; count them and keep the bytes as a
  // (stale) clean copy for the next launch.
  void retire_dirty() {
    uint64_t lost = 0;
    for (auto& entry : lines) {
      if (entry.second.dirty == 0) continue;
      ++lost;
      if (std::getenv("GEMM_AR_SIM_REPORT_LOST") != nullptr) {
        std::fprintf(stderr, "sim_data_cache: line %#llx lost stores (byte mask %#llx)\n",
                     static_cast<unsigned long long>(entry.first), static_cast<unsigned long long>(entry.second.dirty));
      }
      entry.second.dirty = 0;
    }
    if (lost != 0) lost_store_lines().fetch_add(lost, std::memory_order_relaxed);
  }
  ~CoreCache() { retire_dirty(); }
};

// Ordering model: a DMA store whose data a flag publishes (tile, atomic add, zeroed subtile) must be followed by a
// release fence (pipe_barrier + dsb on the device) before the flag is raised, or a peer may see the flag first.
// The kernels mark such stores (note_payload_store); a flag raised while one is still unfenced on this core is
// counted here, and the simulator test expects zero.
inline std::atomic<uint64_t>& unfenced_flags() {
  static std::atomic<uint64_t> count{0};
  return count;
}
inline bool& payload_unfenced() {
  thread_local bool pending = false;
  return pending;
}

// Acquire side: once a flag was seen raised, a load or store that the flag guards (note_guarded_access) must come
// after an acquire_fence(), or it may run ahead of the flag on the device. Counted here; the test expects zero.
inline std::atomic<uint64_t>& unfenced_accesses() {
  static std::atomic<uint64_t> count{0};
  return count;
}
inline bool& acquire_pending() {
  thread_local bool pending = false;
  return pending;
}

// The cache of the simulated core this thread runs as; a thread that was never bound keeps its own.
inline CoreCache*& bound_core() {
  thread_local CoreCache* bound = nullptr;
  return bound;
}
inline CoreCache& core() {
  thread_local CoreCache own;
  return bound_core() != nullptr ? *bound_core() : own;
}

// For the harness: this thread now runs as the core owning `cache` (nullptr: unbind).
inline void bind_core(CoreCache* cache) { bound_core() = cache; }

inline uint8_t* memory_at(uint64_t addr) { return reinterpret_cast<uint8_t*>(addr); }

inline void refresh(Line& line, uint64_t base, uint64_t from) {
  for (uint64_t i = from; i < kLineBytes; ++i) {
    if ((line.dirty >> i) & 1u) continue;
    line.bytes[i] = __atomic_load_n(memory_at(base + i), __ATOMIC_RELAXED);
  }
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
}

inline Line& line_of(uint64_t base) {
  auto found = core().lines.try_emplace(base);
  if (found.second) refresh(found.first->second, base, 0);
  return found.first->second;
}

inline void check_access(uint64_t addr, uint64_t bytes) {
  if (addr / kLineBytes != (addr + bytes - 1) / kLineBytes) {
    std::fprintf(stderr, "sim_data_cache: scalar access of %llu bytes at %#llx straddles a cache line\n",
                 static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(addr));
    std::abort();
  }
}

template <typename T>
inline T load(const volatile void* p) {
  const uint64_t addr = reinterpret_cast<uint64_t>(p);
  check_access(addr, sizeof(T));
  const uint64_t base = addr / kLineBytes * kLineBytes;
  const Line& line = line_of(base);
  T value;
  std::memcpy(&value, line.bytes + (addr - base), sizeof(T));
  return value;
}

template <typename T>
inline void store(volatile void* p, T value) {
  const uint64_t addr = reinterpret_cast<uint64_t>(p);
  check_access(addr, sizeof(T));
  const uint64_t base = addr / kLineBytes * kLineBytes;
  Line& line = line_of(base);
  const uint64_t at = addr - base;
  std::memcpy(line.bytes + at, &value, sizeof(T));
  line.dirty |= ((sizeof(T) >= 64 ? ~0ull : ((1ull << sizeof(T)) - 1)) << at);
}

// dcci(p, SINGLE_CACHE_LINE): write back and invalidate [p, next 64-byte boundary).
inline void dcci_from(const volatile void* p) {
  const uint64_t addr = reinterpret_cast<uint64_t>(p);
  const uint64_t base = addr / kLineBytes * kLineBytes;
  auto found = core().lines.find(base);
  if (found == core().lines.end()) return;
  Line& line = found->second;
  const uint64_t from = addr - base;
  __atomic_thread_fence(__ATOMIC_RELEASE);
  if (line.dirty != 0) {
    // Whole-line write-back: the covered bytes go out as this core has them, stored or merely (stale) cached.
    for (uint64_t i = from; i < kLineBytes; ++i) __atomic_store_n(memory_at(base + i), line.bytes[i], __ATOMIC_RELAXED);
  }
  line.dirty &= from == 0 ? 0ull : ((1ull << from) - 1);
  if (from == 0) {
    core().lines.erase(found);  // the whole line is covered: dropped
  } else {
    refresh(line, base, from);  // only the covered part is fresh; bytes below `from` keep their cached copy
  }
}

}  // namespace sim_cache
}  // namespace device
}  // namespace gemm_ar
