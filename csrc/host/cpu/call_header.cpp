#include "cpu/call_header.h"

#include <gemm_ar/epoch.hpp>
#include <gemm_ar/layout.hpp>

#include <cstring>

#include "cpu/shm_sync.h"

namespace gemm_ar::cpu {

static_assert(sizeof(CallHeader) <= static_cast<size_t>(kHeaderBytes), "call header outgrew its window region");

namespace {
CallHeader* header_of(const void* window) { return static_cast<CallHeader*>(const_cast<void*>(window)); }
}  // namespace

void publish_header(void* window, uint32_t epoch, const CallSignature& signature) {
  CallHeaderSlot& slot = header_of(window)->slots[epoch & 1];
  for (int64_t f = 0; f < kSignatureFields; ++f) {
    std::atomic_ref<int64_t>(slot.signature[f]).store(signature[f], std::memory_order_relaxed);
  }
  store_release(&slot.epoch, epoch);
}

void publish_abort(void* window, uint32_t epoch) { store_release(&header_of(window)->abort_epoch, epoch); }

bool abandoned(const void* window, uint32_t epoch) { return load_acquire(&header_of(window)->abort_epoch) == epoch; }

bool started_call(const void* window, uint32_t epoch) {
  return counter_reached(load_acquire(&header_of(window)->slots[epoch & 1].epoch), epoch);
}

PeerCallState read_header(const void* window, uint32_t epoch, CallSignature* signature) {
  CallHeader* h = header_of(window);
  CallHeaderSlot& slot = h->slots[epoch & 1];
  if (load_acquire(&h->abort_epoch) == epoch) return PeerCallState::kAbandoned;
  const uint32_t before = load_acquire(&slot.epoch);
  if (before != epoch) return counter_reached(before, epoch) ? PeerCallState::kAbandoned : PeerCallState::kNotYet;
  for (int64_t f = 0; f < kSignatureFields; ++f) {
    (*signature)[f] = std::atomic_ref<int64_t>(slot.signature[f]).load(std::memory_order_relaxed);
  }
  // Re-read (seqlock): a slot overwritten meanwhile means the peer is two calls ahead, which only an abandoned
  // call allows.
  std::atomic_thread_fence(std::memory_order_acquire);
  if (load_acquire(&slot.epoch) != epoch || load_acquire(&h->abort_epoch) == epoch) return PeerCallState::kAbandoned;
  return PeerCallState::kArrived;
}

}  // namespace gemm_ar::cpu
