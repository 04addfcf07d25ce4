// Synchronisation on memory shared between processes: atomics with explicit memory order on words inside a
// window (std::atomic_ref, lock-free and address-free), and a doorbell (an eventcount on a futex) so that waiting
// threads sleep instead of taking the cores that the GEMM needs.
#pragma once
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

namespace gemm_ar::cpu {

static_assert(std::atomic_ref<uint32_t>::is_always_lock_free, "shared-memory flags need lock-free 32-bit atomics");

inline uint32_t load_acquire(const uint32_t* word) {
  return std::atomic_ref<uint32_t>(*const_cast<uint32_t*>(word)).load(std::memory_order_acquire);
}
inline void store_release(uint32_t* word, uint32_t value) {
  std::atomic_ref<uint32_t>(*word).store(value, std::memory_order_release);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Pauses a waiter spins before it sleeps on a doorbell: ~50-100 us.
constexpr int kWaitSpins = 2000;
// The agreement of an `auto` tuning call spins this long (~10-20 ms) before sleeping: a rank that slept there
// would start the timed call a futex wake-up after its peers, and its peers then wait inside the call, which
// inflates small calls' tuning times well beyond what they take back to back
// (docs/decisions/0002-algorithms-and-measured-auto.md).
constexpr int kAlignSpins = 400'000;

// A doorbell is two words on their own cache line of a window: a sequence number bumped by every ring, and the
// number of threads asleep on it (so a ring costs a syscall only when someone sleeps). It is a wake-up hint only:
// waiters always re-check their real condition (the epoch flags), and sleep in bounded slices.
struct Doorbell {
  uint32_t* seq;
  uint32_t* sleepers;

  static Doorbell at(void* line) {
    auto* words = static_cast<uint32_t*>(line);
    return Doorbell{words, words + 1};
  }

  void ring() const {
    std::atomic_ref<uint32_t>(*seq).fetch_add(1, std::memory_order_seq_cst);
    if (std::atomic_ref<uint32_t>(*sleepers).load(std::memory_order_seq_cst) != 0) {
      syscall(SYS_futex, seq, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
    }
  }

  uint32_t snapshot() const { return std::atomic_ref<uint32_t>(*seq).load(std::memory_order_seq_cst); }

  // Sleeps until a ring after `seen`, or `slice_ns` passed. Callers re-check their condition either way.
  void sleep(uint32_t seen, int64_t slice_ns) const {
    std::atomic_ref<uint32_t> count(*sleepers);
    count.fetch_add(1, std::memory_order_seq_cst);
    if (snapshot() == seen) {
      timespec slice{static_cast<time_t>(slice_ns / 1000000000), static_cast<long>(slice_ns % 1000000000)};
      syscall(SYS_futex, seq, FUTEX_WAIT, seen, &slice, nullptr, 0);
    }
    count.fetch_sub(1, std::memory_order_seq_cst);
  }
};

}  // namespace gemm_ar::cpu
