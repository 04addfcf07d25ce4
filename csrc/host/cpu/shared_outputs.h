// Opt-in (TORCH_GEMM_AR_SHARED_OUTPUTS): gemm_allreduce outputs that live in the rank's window, so that peers copy
// an owner's reduced rows straight from its output. With private outputs an owner writes its reduced rows twice, into
// its output and into a bank its peers copy from; slots save that second write, which matters where the
// communication dominates (docs/journal/performance-journal.md, "Outputs in shared memory, opt-in").
// Each window ends in a few output slots; a call whose output fits a free slot returns a tensor there, and the owner
// tells its peers, per call parity, where its rows are (a slot or the bank). The owner returns only once every peer
// has copied its rows (publish_copies_done): the caller may overwrite or free its output at once. A slot is free
// again when its tensor is freed; tensors keep their window mapped after the windows grow or the engine is released.
// All slots held (a caller keeping many outputs), or /dev/shm full: a private output and the bank.
// Off by default because such an output is not quite an ordinary tensor
// (docs/decisions/0006-cpu-engine-shared-memory-windows.md asks for one): its storage is not resizable, it counts
// against /dev/shm, and a fork()ed child shares it with the parent instead of copying it on write.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "cpu/fused_call.h"

namespace gemm_ar::cpu {

// Control-area words (after the doorbells): the output slot of this rank's rows per call parity, and the last call
// whose peers' rows this rank has all copied. Each on its own cache line.
constexpr int64_t kOutputSlotWordsOffset = kDoorbellsOffset + (kMainDoorbell + 1) * kCacheLine;
constexpr int64_t kCopiesDoneOffset = kOutputSlotWordsOffset + kCacheLine;
static_assert(kCopiesDoneOffset + kCacheLine <= kControlBytes, "control area too small");
constexpr uint32_t kRowsInBank = 0;  // slot word: the rows are in the bank (slot s is stored as s + 1)

// Bytes from a window's base to its slot `slot` (from 0), for the owner that writes it and the peers that read it.
inline int64_t output_slot_offset(int64_t first_offset, int64_t slot_bytes, int slot) {
  return first_offset + slot * slot_bytes;
}

// Output slots per window: TORCH_GEMM_AR_SHARED_OUTPUTS (default 0: every output private, an ordinary tensor; 2 is
// what a loop needs that keeps its previous output while it makes the next) until set_shared_output_slots. Ranks
// must agree (it is in the engine-mode field: their windows would differ in size).
constexpr int kMaxOutputSlots = 15;
int shared_output_slots();
// Returns the previous value; takes effect from the next call (slots grow with the windows).
int set_shared_output_slots(int slots);
// Smaller outputs stay private: the bank write an output in a slot saves is worth less there than the owner's wait
// for its peers' copies at the end of the call.
constexpr int64_t kMinSlotOutputBytes = int64_t{1} << 20;

// The slots at the end of this rank's current window. Made anew whenever the windows are regrown; tensors of older
// slots keep their own window mapped and return their slot to the old set, which nobody takes from any more.
class SharedOutputSlots {
 public:
  SharedOutputSlots(std::shared_ptr<const SharedSegment> window, int64_t first_offset, int64_t slot_bytes, int slots);
  // A [rows, cols] tensor of `dtype` in a free slot and the slot, or {undefined, -1} (too large or none free).
  std::pair<at::Tensor, int> take(int64_t rows, int64_t cols, at::ScalarType dtype);
  // Bytes from the window's base (the same in every rank's window).
  int64_t slot_offset(int slot) const { return output_slot_offset(state_->first_offset, state_->slot_bytes, slot); }

 private:
  struct State {
    std::shared_ptr<const SharedSegment> window;
    int64_t first_offset, slot_bytes;
    std::mutex mutex;
    std::vector<char> held;       // kFree, kHeld (a live tensor) or kUnusable (its pages could not be committed)
    std::vector<char> populated;  // pages committed (the slot's first use)
  };
  static constexpr char kFree = 0, kHeld = 1, kUnusable = 2;
  std::shared_ptr<State> state_;
};

// The owner's side, before the first final flag of the call (those flags' release order carries it to peers).
void publish_output_slot(uint8_t* window, int64_t bank, uint32_t slot_word);
// The peers' side, after acquiring a final flag of the owner's in this call: where its rows are.
uint32_t read_output_slot(const uint8_t* window, int64_t bank);
// After this rank has copied every peer's rows of call `epoch` (release: its reads are done before the owner reuses
// or the caller changes the output).
void publish_copies_done(uint8_t* window, uint32_t epoch);
// The owner of a slot output: waits until every peer has copied its rows of the job's call (bounded; throws naming
// a late, dead or abandoning peer). With the test hook shared_output_no_wait (a negative control) returns at once.
void wait_for_peer_copies(const CallJob& job);

// Calls this process returned a slot output from (tests: the path is really taken).
int64_t shared_output_call_count();

}  // namespace gemm_ar::cpu
