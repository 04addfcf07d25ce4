// The in-kernel rank agreement: before any data moves, comm block 0 of every rank writes the call signature the host
// put in KernelArgs into slot [epoch & 1][me] of its OWN window, and every comm block reads (bounded) every peer's
// slot in THAT PEER's window and compares it with its own. The host therefore needs no exchange of its own per
// call, and no synchronisation: a rank that called with other sizes, dtype, bias or algorithm, or that rejected its
// arguments, makes every rank's kernel stop before it writes into a peer, with the reason in each rank's ErrorRecord.
//
// Why pull, not push: until a peer's comm kernel runs, HCCL may still be using the peer's window (a large collective
// on the same communicator the peer has not finished, or an async op nobody waited for), and a write into it would
// corrupt that collective. A peer's signature of this call, seen in its window, says its comm kernel of this call
// has started, so its earlier stream work, HCCL's included, has ended; and unless it fails it stays in the call
// until every write of the call addressed to it has arrived (the exit rule, kernel_args.hpp). No remote write of a
// call precedes that: only comm blocks write remotely, and only once CommBlockBase::agree passed.
//
// Ordering: the writer drops the slot's payload lines, stores the words and their complements, writes the lines back
// (dcci), fences (release_fence: the payload reaches GM first) and then raises the slot's 128-bit flag. The reader
// polls the peer's flag with an invalidate before every read (flag_raised), fences (acquire_fence) and drops the
// payload lines before reading them. Words whose complement does not match (a torn or forged slot) are re-read a
// few times and then reported, never accepted.
// Banks: a rank rewrites its slot in bank e & 1 at call e + 2. Its call e + 1 saw every peer's e + 1 signature, which
// a peer publishes only after its call-e kernel (all of that call's reads of the slot) ended. If call e + 1 gave up
// before that, a peer still in call e finds no flag of e (a timeout) or the newer words, torn or whole, which it
// compares like any others: it never accepts words that differ from its own.
#pragma once
#include "remote_window.hpp"

namespace gemm_ar {
namespace device {

constexpr int kSignatureRereads = 8;  // a torn slot is re-read this many times before it is reported

struct SignatureVerdict {
  int32_t code;  // kErrNone: every rank called with this signature and no rank rejected its arguments
  int32_t peer;
  int64_t item;
};

// The flag of rank `source`'s slot for this call, as rank `reader` reads it: in the source's own window (in the
// reader's under the simulator-only kControlSignaturePush, a push).
AICORE inline __gm__ uint32_t* signature_flag(const RemoteWindows& win, const KernelArgs& args, int32_t source,
                                              int32_t reader) {
  const int32_t home = negative_control() == kControlSignaturePush ? reader : source;
  return win.at<uint32_t>(home, signature_slot_offset(args.world, args.epoch, source));
}

AICORE inline __gm__ int64_t* signature_words(__gm__ uint32_t* flag) {
  return reinterpret_cast<__gm__ int64_t*>(reinterpret_cast<__gm__ uint8_t*>(flag) + kFlagStride);
}

constexpr int64_t kSignaturePayloadBytes = 2 * kSignatureWords * static_cast<int64_t>(sizeof(int64_t));

// Block 0 of each rank: `words` into this rank's slot for this call, in its own window (under the push control:
// into every peer's window instead).
AICORE inline void publish_signature(const RemoteWindows& win, const KernelArgs& args, const int64_t* words) {
  const uint32_t tag = signal_tag(args.epoch);
  const uint32_t tag_high = signal_tag_high(args.epoch);
  const bool push = negative_control() == kControlSignaturePush;
  for (int32_t i = push ? 1 : 0; i < (push ? args.world : 1); ++i) {
    __gm__ uint32_t* flag = signature_flag(win, args, args.rank, (args.rank + i) % args.world);
    __gm__ int64_t* payload = signature_words(flag);
    // No stale cached copy may be written back over the words.
    if (site_kept(kControlSignatureNotDropped)) invalidate_lines(payload, kSignaturePayloadBytes);
    for (int64_t w = 0; w < kSignatureWords; ++w) {
      scalar_store<int64_t>(payload + w, words[w]);
      scalar_store<int64_t>(payload + kSignatureWords + w, ~words[w]);
    }
    if (negative_control() != kControlSignatureUnflushed) {
      invalidate_lines(payload, kSignaturePayloadBytes);  // dcci writes the dirty lines back
    }
    if (site_kept(kControlSignatureUnfenced)) release_fence();  // payload in GM before the flag
    raise_flag(flag, tag, tag_high);
  }
}

// Every block: peer `source`'s words (and complements) once its flag for this call is up; false if they stay torn.
AICORE inline bool read_signature(__gm__ uint32_t* flag, int64_t* words) {
  __gm__ int64_t* payload = signature_words(flag);
  for (int attempt = 0; attempt < kSignatureRereads; ++attempt) {
    if (site_kept(kControlSignatureStale)) invalidate_lines(payload, kSignaturePayloadBytes);
    note_guarded_access();  // the words the slot's flag published
    bool whole = true;
    for (int64_t w = 0; w < kSignatureWords; ++w) {
      words[w] = scalar_load<int64_t>(payload + w);
      whole = whole && scalar_load<int64_t>(payload + kSignatureWords + w) == ~words[w];
    }
    if (whole) return true;
    idle_pause();
  }
  return false;
}

// Waits (bounded by args.wait_timeout_us, and stopping when another block of this rank failed) for every peer's
// signature of this call, then judges them all: the lowest rank that rejected its arguments (this one included)
// first, then the lowest rank whose signature differs from `mine`. Every block reads every signature before it
// decides, so all ranks reach the same decision (pass or fail).
AICORE inline SignatureVerdict check_signatures(const RemoteWindows& win, const KernelArgs& args, const int64_t* mine) {
  const uint32_t tag = signal_tag(args.epoch);
  const uint32_t tag_high = signal_tag_high(args.epoch);
  const uint64_t timeout = args.wait_timeout_us != 0 ? args.wait_timeout_us : kDefaultWaitTimeoutUs;
  for (int32_t source = 0; source < args.world; ++source) {
    if (source == args.rank) continue;
    __gm__ uint32_t* flag = signature_flag(win, args, source, args.rank);
    const uint64_t start = now_us();
    while (!flag_raised(flag, tag, tag_high)) {
      if (aborted(args)) return {kErrAborted, -1, -1};
      if (now_us() - start > timeout) return {kErrTimeoutPrepare, source, -1};  // the peer never started the call
      idle_pause();
    }
  }
  if (site_kept(kControlSignatureAcquire)) acquire_fence();
  if (negative_control() == kControlSkipSignatureCheck) return {kErrNone, -1, -1};
  SignatureVerdict rejected{kErrNone, -1, -1};
  SignatureVerdict differs{kErrNone, -1, -1};
  int64_t theirs[kSignatureWords];
  for (int32_t source = 0; source < args.world; ++source) {
    const int64_t* words = mine;
    if (source != args.rank) {
      if (!read_signature(signature_flag(win, args, source, args.rank), theirs)) {
        if (differs.code == kErrNone) differs = {kErrSignatureMismatch, source, -2};
        continue;
      }
      words = theirs;
    }
    if (words[0] != 0 && rejected.code == kErrNone) rejected = {kErrPeerRejected, source, words[0]};
    for (int64_t w = 1; w < kSignatureWords && differs.code == kErrNone; ++w) {
      if (words[w] != mine[w]) differs = {kErrSignatureMismatch, source, w};
    }
  }
  return rejected.code != kErrNone ? rejected : differs;
}

}  // namespace device
}  // namespace gemm_ar
