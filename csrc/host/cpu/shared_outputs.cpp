#include "cpu/shared_outputs.h"

#include <sys/mman.h>

#include <atomic>

#include "common/settings.h"
#include "common/test_hooks.h"
#include "cpu/call_waits.h"

namespace gemm_ar::cpu {
namespace {

std::atomic<int64_t> slot_output_calls{0};
// Output slots per window: TORCH_GEMM_AR_SHARED_OUTPUTS until set (-1: not read yet).
std::atomic<int> output_slots{-1};

}  // namespace

int shared_output_slots() {
  std::atomic<int>& slots = output_slots;
  int value = slots.load();
  if (value < 0) {
    // First use: the environment's choice, unless another thread set one meanwhile.
    const auto from_env = static_cast<int>(env_int(Setting::kSharedOutputs, 0, 0, kMaxOutputSlots));
    slots.compare_exchange_strong(value, from_env);
    value = slots.load();
  }
  return value;
}

int set_shared_output_slots(int slots) {
  TORCH_CHECK_VALUE(slots >= 0 && slots <= kMaxOutputSlots, "shared output slots must be in [0, ", kMaxOutputSlots,
                    "]; got ", slots);
  const int previous = shared_output_slots();
  output_slots.store(slots);
  return previous;
}

SharedOutputSlots::SharedOutputSlots(std::shared_ptr<const SharedSegment> window, int64_t first_offset,
                                     int64_t slot_bytes, int slots)
    : state_(std::make_shared<State>()) {
  state_->window = std::move(window);
  state_->first_offset = first_offset;
  state_->slot_bytes = slot_bytes;
  state_->held.assign(static_cast<size_t>(slots), kFree);
  state_->populated.assign(static_cast<size_t>(slots), 0);
}

std::pair<at::Tensor, int> SharedOutputSlots::take(int64_t rows, int64_t cols, at::ScalarType dtype) {
  if (rows * cols * static_cast<int64_t>(c10::elementSize(dtype)) > state_->slot_bytes) return {at::Tensor(), -1};
  int slot = -1;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    for (size_t s = 0; s < state_->held.size() && slot < 0; ++s) {
      if (state_->held[s] == kFree) {
        state_->held[s] = kHeld;
        slot = static_cast<int>(s);
      }
    }
  }
  if (slot < 0) return {at::Tensor(), -1};
  auto* data = static_cast<uint8_t*>(const_cast<void*>(state_->window->data())) + slot_offset(slot);
  if (!state_->populated[static_cast<size_t>(slot)]) {
    // Commit the slot's pages now: on a full /dev/shm this fails here (and the call keeps a private output) instead
    // of raising SIGBUS at the first store into it. Only this thread touches the flag while it holds the slot.
    if (madvise(data, static_cast<size_t>(state_->slot_bytes), MADV_POPULATE_WRITE) != 0) {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->held[static_cast<size_t>(slot)] = kUnusable;
      return {at::Tensor(), -1};
    }
    state_->populated[static_cast<size_t>(slot)] = 1;
  }
  slot_output_calls.fetch_add(1, std::memory_order_relaxed);
  // The deleter may run on any thread, after the engine is gone: it holds the slots' state and the mapping.
  std::shared_ptr<State> state = state_;
  auto release = [state, slot](void*) {
    std::lock_guard<std::mutex> lock(state->mutex);
    state->held[static_cast<size_t>(slot)] = kFree;
  };
  return {at::from_blob(data, {rows, cols}, release, at::TensorOptions().dtype(dtype)), slot};
}

void publish_output_slot(uint8_t* window, int64_t bank, uint32_t slot_word) {
  // Relaxed is enough: peers read it only after acquiring a final flag that this rank releases afterwards.
  std::atomic_ref<uint32_t>(*window_word(window + kOutputSlotWordsOffset + (bank & 1) * 4))
      .store(slot_word, std::memory_order_relaxed);
}

uint32_t read_output_slot(const uint8_t* window, int64_t bank) {
  // Ordered by the caller's acquire of the owner's final flag (see publish_output_slot).
  return std::atomic_ref<uint32_t>(*window_word(const_cast<uint8_t*>(window) + kOutputSlotWordsOffset + (bank & 1) * 4))
      .load(std::memory_order_relaxed);
}

void publish_copies_done(uint8_t* window, uint32_t epoch) {
  store_release(window_word(window + kCopiesDoneOffset), epoch);
}

void wait_for_peer_copies(const CallJob& job) {
  if (test_hooks::shared_output_no_wait()) return;
  // Exactly this call: a peer's word only moves forward, and it cannot pass call e before this rank starts e + 1.
  auto copied = [&](int r) { return load_acquire(window_word(job.windows[r] + kCopiesDoneOffset)) == job.epoch; };
  const std::string call_name = "call " + std::to_string(job.epoch);
  bounded_wait(
      [&] {
        for (int r = 0; r < job.world; ++r)
          if (r != job.rank && !copied(r)) return false;
        return true;
      },
      no_progress, [&] { watch_peers(job, call_name); },
      [&] {
        return late_ranks(job.world, job.rank, [&](int r) { return !copied(r); }) +
               " did not copy this rank's output rows of " + call_name + wait_bound(job);
      },
      doorbell(job.windows[job.rank], kMainDoorbell), job.timeout, nullptr);
}

int64_t shared_output_call_count() { return slot_output_calls.load(std::memory_order_relaxed); }

}  // namespace gemm_ar::cpu
