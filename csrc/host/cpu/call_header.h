// The per-call header at the start of every rank's window: the call number (epoch) and the call signature of its
// latest call, plus the last call it abandoned. Peers read it to agree on a call before touching its data, and to
// stop waiting on a rank that gave up.
#pragma once
#include <cstdint>
#include <optional>

#include "common/rank_agreement.h"

namespace gemm_ar::cpu {

struct CallHeader {
  uint32_t epoch;        // the call `signature` describes; stored last, with release order
  uint32_t abort_epoch;  // the latest call this rank abandoned after an error
  int64_t signature[kSignatureFields];
};

enum class PeerCallState { kNotYet, kArrived, kAbandoned };

// Writes this rank's signature for call `epoch`, then the epoch (release).
void publish_header(void* window, uint32_t epoch, const CallSignature& signature);
// Tells peers that this rank gave up call `epoch`.
void publish_abort(void* window, uint32_t epoch);
// Where a peer stands with call `epoch`; fills `signature` when it has arrived. A peer whose header already names
// a later call, or that abandoned this one, has abandoned it (it cannot finish a call without this rank).
PeerCallState read_header(const void* window, uint32_t epoch, CallSignature* signature);
bool abandoned(const void* window, uint32_t epoch);

}  // namespace gemm_ar::cpu
