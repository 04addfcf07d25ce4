// The per-call header at the start of every rank's window: the call number (epoch) and the call signature of its
// latest call, plus the last call it abandoned. Peers read it to agree on a call before touching its data, and to
// stop waiting on a rank that gave up.
#pragma once
#include <cstdint>
#include <optional>

#include "common/rank_agreement.h"

namespace gemm_ar::cpu {

// Two slots, by call parity: a peer that has read this rank's call e may already publish call e+1 while slower
// ranks still read call e; it cannot reach call e+2 before every rank has published e+1 (so has finished e).
struct CallHeaderSlot {
  uint32_t epoch;  // the call `signature` describes; stored last, with release order
  uint32_t unused;
  int64_t signature[kSignatureFields];
};
struct CallHeader {
  CallHeaderSlot slots[2];
  uint32_t abort_epoch;  // the latest call this rank abandoned after an error
};

// Bytes the header takes at the start of the window's control area (cpu/fused_call.h).
constexpr int64_t kHeaderBytes = 512;

enum class PeerCallState { kNotYet, kArrived, kAbandoned };

// Writes this rank's signature for call `epoch`, then the epoch (release).
void publish_header(void* window, uint32_t epoch, const CallSignature& signature);
// Tells peers that this rank gave up call `epoch`.
void publish_abort(void* window, uint32_t epoch);
// Where a peer stands with call `epoch`; fills `signature` when it has arrived.
PeerCallState read_header(const void* window, uint32_t epoch, CallSignature* signature);
bool abandoned(const void* window, uint32_t epoch);
// Whether the rank of `window` has published its header of call `epoch` or of a later call of the same parity
// (acquire): it has started that call, so it has finished every call before it.
bool started_call(const void* window, uint32_t epoch);

}  // namespace gemm_ar::cpu
