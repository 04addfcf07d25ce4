// Simulator builds only (-D__CPU_SIM): a strict model of the AICore scalar data cache in front of GM, so the CPU
// simulator sees what the hardware sees (docs/ascend.md, "The strict simulator"). pto-isa's simulator has coherent
// memory and no-op dcci and dsb; here every simulated core (one block thread) keeps its own cache of 64-byte lines:
//  - a scalar load fills the line from memory once and then returns that copy, however stale, until a dcci drops it;
//  - a scalar store goes into the line (write-allocate) and stays invisible to every other core until the line is
//    written back: by a dcci covering the stored bytes, or by an eviction (below, when turned on);
//  - a write-back sends every byte it covers as this core last saw it, stale bytes it never stored included (the
//    line is the unit of write-back), so a stale copy can overwrite what others wrote meanwhile;
//  - dcci(p, SINGLE_CACHE_LINE) covers p up to the next 64-byte boundary only (AscendC's documented behaviour
//    for an unaligned address): bytes below p in the same line are neither written back nor refreshed;
//  - a store that no write-back ever covers is never seen. Such lines are counted when the core's kernel ends
//    (lost_store_lines()), and the simulator test expects zero;
//  - lines outlive the kernel: the harness binds each simulated core to one CoreCache for the whole run
//    (bind_core), so the next launch on that core starts with whatever the last one left cached, as on hardware.
// Two parts a busy device would add are off unless the simulator test turns them on for a run (environment):
//  - eviction (GEMM_AR_SIM_EVICT_PERMILLE=p): at each scalar load or store, with probability p/1000, one random
//    dirty line of the core is written back whole and dropped, as a cache may do at any time. A store is then
//    visible from the moment it is made, not only from the dcci that the code placed after its fence;
//  - posted write-backs (GEMM_AR_SIM_POSTED_US=d): a write-back (dcci or eviction) leaves the core at once but lands
//    in memory only after a random delay of 0..d us, each on its own, so two write-backs of a core land in either
//    order; a dsb (device_support.hpp's ddr_barrier(), which every fence and flag uses) waits until all of them
//    have landed, in landing order, as the real dsb waits for the core's outstanding writes. Write-backs of one
//    line land in the order they were made, and the core itself sees its own posted bytes at once.
// GEMM_AR_SIM_MODEL_SEED seeds both (each core draws from its own generator).
// The pipes of a core (below the cache model):
//  - set_flag/wait_flag balance, always on: every set_flag of a core must be matched by one wait_flag of the same
//    (src pipe, dst pipe, event) before the kernel ends, and no wait_flag may come without a pending set_flag (on
//    the device it would hang, and a set left over would release the next kernel's wait too early);
//  - asynchronous DMA completion (GEMM_AR_SIM_ASYNC_DMA=1): a tile store to GM (TSTORE, atomic add included) is
//    only queued, and runs (reading its local tile then, as the DMA engine does) at the core's next
//    synchronisation point on its pipe: a wait_flag for a set_flag of that pipe raised after the store, a
//    pipe_barrier of that pipe or of PIPE_ALL (every fence), or the kernel's end. A tile refilled, or a flag raised,
//    before such a point then shows up as wrong data or an error.
// Tile copies (TLOAD/TSTORE, atomic adds) bypass this cache, as the DMA engines do on the device.
// Write-backs land as relaxed byte stores after a release fence and fills are relaxed byte loads before an acquire
// fence, so C++ orders the payload (written by the tile copies) before a flag exactly where the kernel flushes it.
#pragma once
#if !defined(__CPU_SIM)
#error "sim_data_cache.hpp is for the CPU simulator only"
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace gemm_ar {
namespace device {
namespace sim_cache {

constexpr uint64_t kLineBytes = 64;

// The optional parts of the model, read once from the environment the simulator test gives the process.
struct Options {
  uint32_t evict_permille = 0;  // GEMM_AR_SIM_EVICT_PERMILLE: chance per scalar access of evicting a dirty line
  uint64_t posted_us = 0;       // GEMM_AR_SIM_POSTED_US: longest landing delay of a write-back (0: lands at once)
  uint64_t seed = 0;            // GEMM_AR_SIM_MODEL_SEED
  bool async_dma = false;       // GEMM_AR_SIM_ASYNC_DMA: tile stores complete at the next synchronisation point
};

inline uint64_t env_u64(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::strtoull(value, nullptr, 10) : 0;
}

inline const Options& options() {
  static const Options parsed = [] {
    Options o;
    o.evict_permille = static_cast<uint32_t>(std::min<uint64_t>(env_u64("GEMM_AR_SIM_EVICT_PERMILLE"), 1000));
    o.posted_us = env_u64("GEMM_AR_SIM_POSTED_US");
    o.seed = env_u64("GEMM_AR_SIM_MODEL_SEED");
    o.async_dma = env_u64("GEMM_AR_SIM_ASYNC_DMA") != 0;
    return o;
  }();
  return parsed;
}

inline uint64_t model_now_us() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

// Dirty lines dropped at thread exit over the whole process: stores no write-back ever published.
inline std::atomic<uint64_t>& lost_store_lines() {
  static std::atomic<uint64_t> lost{0};
  return lost;
}

// Dirty lines the model evicted, and write-backs that were posted: a run that turned either on and shows zero
// exercised nothing.
inline std::atomic<uint64_t>& evicted_lines() {
  static std::atomic<uint64_t> count{0};
  return count;
}
inline std::atomic<uint64_t>& posted_writebacks() {
  static std::atomic<uint64_t> count{0};
  return count;
}

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

// The same rule seen from the cache: a line written back (by a dcci or an eviction) while a payload store of this
// core is unfenced carries a scalar store (a flag, or words a flag publishes) to memory ahead of that payload. The
// kernels make no such write-back; a flag stored before the fence and flushed after it does, once eviction is on.
inline std::atomic<uint64_t>& unfenced_writebacks() {
  static std::atomic<uint64_t> count{0};
  return count;
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

// ---- The pipes of a core: set_flag/wait_flag balance and asynchronous tile stores ----

// Waits with no pending set_flag (a hang on the device), set_flags still pending when a kernel ends (they would
// release the next kernel's waits early), and tile stores the asynchronous DMA model queued. The first two must
// be zero; the third shows that a run with the model on exercised it.
inline std::atomic<uint64_t>& sync_waits_without_set() {
  static std::atomic<uint64_t> count{0};
  return count;
}
inline std::atomic<uint64_t>& sync_sets_unwaited() {
  static std::atomic<uint64_t> count{0};
  return count;
}
inline std::atomic<uint64_t>& deferred_tile_stores() {
  static std::atomic<uint64_t> count{0};
  return count;
}

constexpr int kPipes = 8;   // PIPE_S .. PIPE_FIX, PIPE_ALL included
constexpr int kEvents = 8;  // EVENT_ID0 .. EVENT_ID7

// One simulated core's pipes (the block thread's: a kernel's flags and stores never outlive its thread, and the
// tiles a queued store reads live in that thread's local memory).
struct PipeState {
  struct Store {
    int pipe;
    uint64_t serial;
    std::function<void()> run;
  };
  // Per (src, dst, event): the serial of the next store at each pending set_flag, oldest first.
  std::vector<uint64_t> pending[kPipes][kPipes][kEvents];
  std::vector<Store> queued;  // in issue order
  uint64_t issued = 0;        // stores issued so far

  // Runs the queued stores of `pipe` (of every pipe for kAnyPipe) issued before serial `before`, in issue order.
  static constexpr int kAnyPipe = -1;
  void land(int pipe, uint64_t before) {
    if (queued.empty()) return;
    std::vector<Store> keep;
    std::vector<Store> due;
    for (Store& st : queued) {
      ((pipe == kAnyPipe || st.pipe == pipe) && st.serial < before ? due : keep).push_back(std::move(st));
    }
    queued = std::move(keep);
    for (Store& st : due) st.run();
  }
};
inline PipeState& pipes() {
  thread_local PipeState state;
  return state;
}

inline std::vector<uint64_t>& pending_sets(int src, int dst, int event) {
  if (src < 0 || src >= kPipes || dst < 0 || dst >= kPipes || event < 0 || event >= kEvents) {
    std::fprintf(stderr, "sim_data_cache: flag (%d, %d, %d) outside the modelled pipes and events\n", src, dst, event);
    std::abort();
  }
  return pipes().pending[src][dst][event];
}

inline void note_set_flag(int src, int dst, int event) {
  PipeState& p = pipes();
  pending_sets(src, dst, event).push_back(p.issued);
}

// A wait_flag: consumes the oldest pending set of its (src, dst, event); stores of pipe src issued before that set
// have completed once it returns.
inline void note_wait_flag(int src, int dst, int event) {
  std::vector<uint64_t>& sets = pending_sets(src, dst, event);
  if (sets.empty()) {
    sync_waits_without_set().fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const uint64_t before = sets.front();
  sets.erase(sets.begin());
  pipes().land(src, before);
}

// pipe_barrier(pipe): every store of that pipe (of every pipe for PIPE_ALL) issued so far has completed.
inline void note_pipe_barrier(int pipe, int all_pipes) {
  PipeState& p = pipes();
  p.land(pipe == all_pipes ? PipeState::kAnyPipe : pipe, p.issued);
}

// A tile store to GM on `pipe`: run now, or queued until a synchronisation point with GEMM_AR_SIM_ASYNC_DMA.
inline void tile_store(int pipe, std::function<void()> store) {
  PipeState& p = pipes();
  if (!options().async_dma) {
    store();
  } else {
    p.queued.push_back(PipeState::Store{pipe, p.issued, std::move(store)});
    deferred_tile_stores().fetch_add(1, std::memory_order_relaxed);
  }
  ++p.issued;
}

// The end of a kernel on this core: its stores complete, and set_flags still pending are counted and dropped.
inline void end_kernel_pipes() {
  PipeState& p = pipes();
  p.land(PipeState::kAnyPipe, p.issued);
  uint64_t unwaited = 0;
  for (auto& by_dst : p.pending) {
    for (auto& by_event : by_dst) {
      for (auto& sets : by_event) {
        unwaited += sets.size();
        sets.clear();
      }
    }
  }
  if (unwaited != 0) sync_sets_unwaited().fetch_add(unwaited, std::memory_order_relaxed);
}

inline uint8_t* memory_at(uint64_t addr) { return reinterpret_cast<uint8_t*>(addr); }

// Bytes [from, kLineBytes) of a line into memory, ordered after everything this thread wrote before.
inline void land_bytes(uint64_t base, const uint8_t* bytes, uint64_t from) {
  __atomic_thread_fence(__ATOMIC_RELEASE);
  for (uint64_t i = from; i < kLineBytes; ++i) __atomic_store_n(memory_at(base + i), bytes[i], __ATOMIC_RELAXED);
}

struct Line {
  uint8_t bytes[kLineBytes];
  uint64_t dirty = 0;  // bit i: byte i stored by this core and not yet written back
};

// A write-back on its way to memory (posted write-backs only).
struct Posted {
  uint64_t base;
  uint64_t from;    // bytes [from, kLineBytes) of the line
  uint64_t due_us;  // when it lands
  uint8_t bytes[kLineBytes];
};

inline uint64_t next_core_serial() {
  static std::atomic<uint64_t> serial{0};
  return serial.fetch_add(1, std::memory_order_relaxed);
}

struct CoreCache {
  std::unordered_map<uint64_t, Line> lines;
  std::vector<uint64_t> dirty_bases;  // lines with dirty bytes: what an eviction picks from
  std::vector<Posted> posted;         // write-backs not landed yet, in landing order
  std::mt19937_64 rng;

  CoreCache() : rng(options().seed * 0x9E3779B97F4A7C15ull + next_core_serial()) {}

  // End of a kernel on this core (its block thread): its pipes end (end_kernel_pipes), and stores still dirty
  // were never published; count them and keep the bytes as a (stale) clean copy for the next launch. The kernel's
  // end also waits for its posted write-backs, as a dsb does.
  void retire_dirty() {
    end_kernel_pipes();
    retire_lines();
  }
  void retire_lines() {
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
    dirty_bases.clear();
    if (lost != 0) lost_store_lines().fetch_add(lost, std::memory_order_relaxed);
    wait_posted();
  }
  ~CoreCache() { retire_lines(); }

  void forget_dirty(uint64_t base) {
    auto it = std::find(dirty_bases.begin(), dirty_bases.end(), base);
    if (it == dirty_bases.end()) return;
    *it = dirty_bases.back();
    dirty_bases.pop_back();
  }

  // Bytes [from, kLineBytes) of a line leave the core. Without posting they land now; with it, after a random delay
  // (never before an earlier write-back of the same line).
  void write_back(uint64_t base, const Line& line, uint64_t from) {
    if (payload_unfenced()) unfenced_writebacks().fetch_add(1, std::memory_order_relaxed);
    const uint64_t most = options().posted_us;
    if (most == 0) {
      land_bytes(base, line.bytes, from);
      return;
    }
    Posted entry;
    entry.base = base;
    entry.from = from;
    std::memcpy(entry.bytes, line.bytes, kLineBytes);
    entry.due_us = model_now_us() + rng() % (most + 1);
    for (const Posted& earlier : posted) {
      if (earlier.base == base) entry.due_us = std::max(entry.due_us, earlier.due_us);
    }
    auto at = std::upper_bound(posted.begin(), posted.end(), entry.due_us,
                               [](uint64_t due, const Posted& p) { return due < p.due_us; });
    posted.insert(at, entry);
    posted_writebacks().fetch_add(1, std::memory_order_relaxed);
  }

  // Lands the posted write-backs that are due by now.
  void land_due() {
    if (posted.empty()) return;
    const uint64_t now = model_now_us();
    size_t landed = 0;
    while (landed < posted.size() && posted[landed].due_us <= now) {
      land_bytes(posted[landed].base, posted[landed].bytes, posted[landed].from);
      ++landed;
    }
    posted.erase(posted.begin(), posted.begin() + static_cast<std::ptrdiff_t>(landed));
  }

  // dsb: returns once every posted write-back of this core has landed, each at its own time.
  void wait_posted() {
    while (!posted.empty()) {
      const uint64_t now = model_now_us();
      if (posted.front().due_us > now)
        std::this_thread::sleep_for(std::chrono::microseconds(posted.front().due_us - now));
      land_due();
    }
  }

  // This core's own posted bytes of a line it (re)reads from memory: a core sees its own writes.
  void overlay_posted(Line& line, uint64_t base, uint64_t from) const {
    for (const Posted& p : posted) {
      if (p.base != base) continue;
      for (uint64_t i = std::max(from, p.from); i < kLineBytes; ++i) {
        if (((line.dirty >> i) & 1u) == 0) line.bytes[i] = p.bytes[i];
      }
    }
  }

  // At a scalar access: maybe write back and drop one random dirty line (eviction), if turned on.
  void maybe_evict() {
    const uint32_t permille = options().evict_permille;
    if (permille == 0 || dirty_bases.empty() || rng() % 1000 >= permille) return;
    const size_t pick = static_cast<size_t>(rng() % dirty_bases.size());
    const uint64_t base = dirty_bases[pick];
    dirty_bases[pick] = dirty_bases.back();
    dirty_bases.pop_back();
    auto found = lines.find(base);
    write_back(base, found->second, 0);  // the whole line leaves the cache
    lines.erase(found);
    evicted_lines().fetch_add(1, std::memory_order_relaxed);
  }
};

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

inline void refresh(const CoreCache& c, Line& line, uint64_t base, uint64_t from) {
  for (uint64_t i = from; i < kLineBytes; ++i) {
    if ((line.dirty >> i) & 1u) continue;
    line.bytes[i] = __atomic_load_n(memory_at(base + i), __ATOMIC_RELAXED);
  }
  c.overlay_posted(line, base, from);
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
}

inline Line& line_of(CoreCache& c, uint64_t base) {
  auto found = c.lines.try_emplace(base);
  if (found.second) refresh(c, found.first->second, base, 0);
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
  CoreCache& c = core();
  c.land_due();
  const uint64_t base = addr / kLineBytes * kLineBytes;
  const Line& line = line_of(c, base);
  T value;
  std::memcpy(&value, line.bytes + (addr - base), sizeof(T));
  c.maybe_evict();
  return value;
}

template <typename T>
inline void store(volatile void* p, T value) {
  const uint64_t addr = reinterpret_cast<uint64_t>(p);
  check_access(addr, sizeof(T));
  CoreCache& c = core();
  c.land_due();
  const uint64_t base = addr / kLineBytes * kLineBytes;
  Line& line = line_of(c, base);
  const uint64_t at = addr - base;
  std::memcpy(line.bytes + at, &value, sizeof(T));
  if (line.dirty == 0) c.dirty_bases.push_back(base);
  line.dirty |= ((sizeof(T) >= 64 ? ~0ull : ((1ull << sizeof(T)) - 1)) << at);
  c.maybe_evict();  // may take this very line: the store is then visible at once
}

// dcci(p, SINGLE_CACHE_LINE): write back and invalidate [p, next 64-byte boundary).
inline void dcci_from(const volatile void* p) {
  const uint64_t addr = reinterpret_cast<uint64_t>(p);
  const uint64_t base = addr / kLineBytes * kLineBytes;
  CoreCache& c = core();
  c.land_due();
  auto found = c.lines.find(base);
  if (found == c.lines.end()) return;
  Line& line = found->second;
  const uint64_t from = addr - base;
  const bool was_dirty = line.dirty != 0;
  // Whole-line write-back: the covered bytes go out as this core has them, stored or merely (stale) cached.
  if (was_dirty) c.write_back(base, line, from);
  line.dirty &= from == 0 ? 0ull : ((1ull << from) - 1);
  if (was_dirty && line.dirty == 0) c.forget_dirty(base);
  if (from == 0) {
    c.lines.erase(found);  // the whole line is covered: dropped
  } else {
    refresh(c, line, base, from);  // only the covered part is fresh; bytes below `from` keep their cached copy
  }
}

}  // namespace sim_cache

#if !defined(GEMM_AR_PLAIN_SCALARS)
// dsb(DSB_DDR) as the kernels call it (unqualified, from this namespace: device_support.hpp's ddr_barrier()). It
// hides pto-isa's no-op ::dsb there, so that a dsb waits for this core's posted write-backs as the model requires.
inline void dsb(::mem_dsb_t) { sim_cache::core().wait_posted(); }

// pipe_barrier as the kernels call it (the same way): the pipe's queued tile stores complete first (asynchronous
// DMA model), then pto-isa's.
inline void pipe_barrier(::pipe_t pipe) {
  sim_cache::note_pipe_barrier(static_cast<int>(pipe), static_cast<int>(PIPE_ALL));
  ::pipe_barrier(pipe);
}
#endif

}  // namespace device
}  // namespace gemm_ar
