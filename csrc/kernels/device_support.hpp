// Small device-side services both kernels need: reading KernelArgs from device memory, a clock for bounded
// waits, cross-core flags with the fences that make data written before them visible, and the error record.
// Compiled by bisheng for AICore (cube and vector) and by g++ in pto-isa's CPU simulator (-D__CPU_SIM).
//
// Every scalar access to GM goes through scalar_load / scalar_store / flush_line. On the device they are plain
// volatile accesses and dcci; in the simulator they run against sim_data_cache.hpp's per-core non-coherent cache,
// so a missing flush or invalidate shows up there as a timeout, a corrupt queue or a lost store
// (docs/decisions/0007-npu-scalar-cache-discipline.md, docs/decisions/0009-checking-npu-code-without-hardware.md). A
// simulator build with -DGEMM_AR_PLAIN_SCALARS compiles them as on the device instead (plain volatile accesses, dcci a
// no-op, no negative controls): tests/test_kernels_device_build.py checks that code the way the device compiler sees
// it.
#pragma once
#include <pto/pto-inst.hpp>

#include "gemm_ar/kernel_args.hpp"
#include "gemm_ar/protocol.hpp"
#include "gemm_ar/sequence_parallel.hpp"

#if defined(__CPU_SIM)
#include <chrono>
#include <cstdlib>
#include <thread>

#include "sim_data_cache.hpp"
#endif

// Whether this build models the device for the simulator test: scalar GM accesses through sim_data_cache.hpp and
// negative controls read from the environment.
#if defined(__CPU_SIM) && !defined(GEMM_AR_PLAIN_SCALARS)
#define GEMM_AR_SIM_MODEL 1
#else
#define GEMM_AR_SIM_MODEL 0
#endif

namespace gemm_ar {
namespace device {

using GmBytes = __gm__ uint8_t*;

// NPU tile sizes (kernel_args.hpp) as int template arguments of tile types, for the cube and the vector kernels.
constexpr int kBaseN = static_cast<int>(kNpuBaseN);
constexpr int kSubM = static_cast<int>(kNpuSubM);

constexpr uint32_t kDefaultWaitTimeoutUs = 30u * 1000u * 1000u;  // used when KernelArgs::wait_timeout_us == 0
constexpr uint64_t kSysCntPerUs = 50;                            // A2/A3 system counter runs at 50 MHz

static_assert(sizeof(KernelArgs) % sizeof(uint64_t) == 0, "KernelArgs is copied as 64-bit words");

// Negative controls of the strict simulator test (tests/test_kernels_sim.py): each re-introduces one known bug so
// the test can show it catches it. Simulator builds read it from the environment variable
// GEMM_AR_SIM_NEGATIVE_CONTROL (one binary serves every control); a device build (or a GEMM_AR_PLAIN_SCALARS one)
// always gets kControlNone.
enum NegativeControl : int {
  kControlNone = 0,
  kControlQueueFlush = 1,          // queue_publish does not flush the tile id's line
                                   // (docs/decisions/0007-npu-scalar-cache-discipline.md, ready-queue slot)
  kControlDropFlush = 2,           // raise_flag does not write its line back
  kControlDropInvalidate = 3,      // flag_raised reads without dropping its cached copy
  kControlSingleWordFlags = 4,     // flag_raised checks the tag word only, not its complement
                                   // (docs/decisions/0003-epoch-tagged-flags-never-reset.md)
  kControlSkipSignatureCheck = 5,  // peers' call signatures are waited for but not compared
                                   // (docs/decisions/0004-rank-agreement-before-data-moves.md)
  kControlSignatureUnflushed = 6,  // the signature words are not written back before their flag
  kControlPayloadUnfenced = 7,     // a reduce-scatter contribution's flag is raised without the release fence
  // One per remaining flush/invalidate site: the site named is left out (tests/test_kernels_sim.py says which the
  // model catches; docs/ascend.md says why the others cannot be seen).
  kControlArgsStale = 8,               // load_kernel_args reads KernelArgs without dropping cached lines
  kControlCounterStale = 9,            // load_kernel_args reads the epoch counter without dropping its line
  kControlFlagNotDropped = 10,         // raise_flag stores into the flag's line without dropping it first
  kControlRecordNotDropped = 11,       // report_error stores the fields without dropping the record's line first
  kControlRecordFieldsUnflushed = 12,  // report_error does not write the fields back before the tag
  kControlRecordTagUnflushed = 13,     // report_error does not write the tag back
  kControlQueueNotDropped = 14,        // queue_publish stores the id without dropping the slot's line first
  kControlQueueIdStale = 15,           // queue_read_id reads the id without dropping the slot's line
  kControlSignatureNotDropped = 16,    // publish_signature stores without dropping the payload lines first
  kControlSignatureStale = 17,         // read_signature reads the payload without dropping its lines
  kControlContextStale = 18,           // RemoteWindows::init reads the CommContext without dropping its lines
  // One per acquire_fence() after a flag was seen: the fence named is left out.
  kControlQueueAcquire = 19,      // QueueCursor::poll: before the tile's id and data are read
  kControlSignatureAcquire = 20,  // check_signatures: before the peers' signature words are read
  kControlPreparedAcquire = 21,   // wait_prepared: before the atomic add into the owner's zeroed subtile
  kControlContribAcquire = 22,    // try_item (own subtile): before the reduced subtile is read
  kControlArrivalAcquire = 23,    // try_item (peer's subtile): before the gathered subtile is read
  // The add+RMSNorm epilogue of the comm kernel (add_rmsnorm_epilogue.hpp).
  kControlEpilogueAcquire = 24,  // a row band is read after its subtiles' flags without the acquire fence
  kControlEpilogueNoWait = 25,   // a row band is normalised without waiting for its subtiles to be final
  kControlSignaturePush = 26,    // the signature is pushed into every peer's window (maybe still HCCL's)
                                 // instead of published in this rank's own (call_signature.hpp)
  // The decode variant of the comm kernel (decode_comm_block.hpp).
  kControlDecodePushUnfenced = 27,   // pushed flags raised without the release fence after the partial's stores
  kControlDecodePushedAcquire = 28,  // peers' partials read after their pushed flags without the acquire fence
  kControlDecodeArrivalOrder = 29,   // partials summed own first, then peers in push order: not rank order
  kControlDecodeNoWait = 30,         // a tile reduced without waiting for the peers' pushed flags
  kControlDecodeFlagUnflushed = 31,  // pushed flags stored but never written back (no dcci)
  kControlDecodeFlagStale = 32,      // pushed flags polled without dropping this core's cached copy first
  // The add+RMSNorm epilogue again (either variant).
  kControlEpilogueNoResidual = 33,  // the residual is left out of `out` (and so of normed)
  // The sequence-parallel kernels' fences (sp_comm_kernel.cpp, sp_compute_kernel.cpp), from 40 on so that the
  // numbers above can grow: each removes one release_fence() before a flag or one acquire_fence() after one.
  kControlRsPayloadUnfenced = 40,   // reduce-scatter: contribution flag raised without a fence after the add
  kControlRsPreparedAcquire = 41,   // reduce-scatter: atomic add into the owner's chunk after its prepared flag
  kControlRsContribAcquire = 42,    // reduce-scatter: own chunk's subtile read after its contribution flags
  kControlAgPublishUnfenced = 43,   // allgather: prepared ("published") flags raised without a fence after the
                                    // shard's stores
  kControlAgPublishedAcquire = 44,  // allgather: a peer's shard pulled after its published flag
  kControlAgPullUnfenced = 45,      // allgather: row-ready flag raised without a fence after the pulled rows
  kControlAgRowAcquire = 46,        // allgather compute: gathered rows loaded after their row-ready flag
  kControlAgNoRowWait = 47,         // allgather compute: peers' rows used without waiting for their flag
  kControlRsZeroUnfenced = 48,      // reduce-scatter: prepared flags raised without a fence after the zeroing
  // From 60 on: bugs only the optional parts of the simulator's models can see (sim_data_cache.hpp; each passes
  // with that part off, tests/test_kernels_sim_models.py), or the flag balance check (62).
  kControlFlagStoredEarly = 60,    // reduce-scatter: a contribution flag's words stored before the release fence
                                   // after the atomic add (written back after it): eviction shows it
  kControlSignatureUnfenced = 61,  // publish_signature raises the flag without the release fence after the
                                   // words' write-back: posted write-backs show it
  kControlDropWaitFlag = 62,       // compute tile: the last wait_flag(PIPE_M, PIPE_MTE1, EVENT_ID1) left out, its
                                   // set_flag pending at the kernel's end: the flag balance counts it (always on)
  kControlMoveTileReused = 63,     // sequence-parallel move(): no MTE3 -> MTE2 hand-over after the stores, so the
                                   // next TLOAD refills the UB tile they read: asynchronous DMA shows it
};
#if GEMM_AR_SIM_MODEL
inline int negative_control() {
  static const int control = [] {
    const char* value = std::getenv("GEMM_AR_SIM_NEGATIVE_CONTROL");
    return value != nullptr ? std::atoi(value) : static_cast<int>(kControlNone);
  }();
  return control;
}
#else
AICORE constexpr inline int negative_control() { return kControlNone; }
#endif

// False only in a simulator run whose negative control removes the site guarded by `control`.
AICORE inline bool site_kept(int control) { return negative_control() != control; }

// The decode variant's k-th summand of column tile t on rank `me`: rank k (every rank sums in rank order, so the
// ranks agree bitwise). Control kControlDecodeArrivalOrder sums this rank's own partial first, then its peers in the
// order it pushed to them.
AICORE inline int32_t decode_summand(int32_t k, int64_t t, int32_t me, int32_t world) {
  if (negative_control() != kControlDecodeArrivalOrder) return k;
  return k == 0 ? me : static_cast<int32_t>(rotated_peer(me, t, k - 1, world));
}

// Cache maintenance, dsb and pipe_barrier order the core, not the compiler: without this it may move scalar
// accesses across them (the poll above the invalidate, the flag store below the write-back).
AICORE inline void compiler_barrier() { __asm__ __volatile__("" ::: "memory"); }

// dsb(DSB_DDR): this core's earlier GM accesses complete before its later ones; kept in place for the compiler too.
AICORE inline void ddr_barrier() {
  compiler_barrier();
  dsb(DSB_DDR);
  compiler_barrier();
}

// dcci(p, SINGLE_CACHE_LINE): writes back and drops p's cache line from p up to the next 64-byte boundary only
// (AscendC's documented behaviour for an unaligned address), so callers pass the lowest address they need covered.
AICORE inline void flush_line(const volatile __gm__ void* p) {
  compiler_barrier();
#if GEMM_AR_SIM_MODEL
  sim_cache::dcci_from(p);
#else
  dcci((__gm__ void*)p, cache_line_t::SINGLE_CACHE_LINE);
#endif
  compiler_barrier();
}

// One scalar word of GM through this core's data cache (memory order: none by itself; see raise_flag).
template <typename T>
AICORE inline T scalar_load(const volatile __gm__ T* p) {
#if GEMM_AR_SIM_MODEL
  return sim_cache::load<T>(p);
#else
  return *p;
#endif
}

template <typename T>
AICORE inline void scalar_store(volatile __gm__ T* p, T value) {
#if GEMM_AR_SIM_MODEL
  sim_cache::store<T>(p, value);
#else
  *p = value;
#endif
}

// AICore keeps a data cache in front of GM for scalar accesses; drop the lines of [p, p + bytes) so the next
// scalar reads see what DMA or other cores wrote.
AICORE inline void invalidate_lines(const volatile __gm__ void* p, int64_t bytes) {
  const uint64_t line = static_cast<uint64_t>(kCacheLine);
  const uint64_t first = reinterpret_cast<uint64_t>(p) / line * line;
  const uint64_t end = reinterpret_cast<uint64_t>(p) + static_cast<uint64_t>(bytes);
  for (uint64_t at = first; at < end; at += line) {
    flush_line(reinterpret_cast<const volatile __gm__ void*>(at));
  }
}

// Word i of an object's bytes, and its replacement: byte copies, so the compiler knows they touch every field
// (reading or writing a struct through a uint64_t* is a type pun it may reorder across the fields' own accesses).
template <typename T>
AICORE inline uint64_t object_word(const T& object, uint64_t i) {
  uint64_t word;
  __builtin_memcpy(&word, static_cast<const uint8_t*>(static_cast<const void*>(&object)) + i * sizeof(uint64_t),
                   sizeof(uint64_t));
  return word;
}
template <typename T>
AICORE inline void set_object_word(T* object, uint64_t i, uint64_t word) {
  __builtin_memcpy(static_cast<uint8_t*>(static_cast<void*>(object)) + i * sizeof(uint64_t), &word, sizeof(uint64_t));
}

// The host's KernelArgs copy, read word by word (kernel parameters can only be pointers and scalars).
AICORE inline void load_kernel_args(GmBytes src, KernelArgs* dst) {
  if (site_kept(kControlArgsStale)) invalidate_lines(src, static_cast<int64_t>(sizeof(KernelArgs)));
  // GM holds the host's bytes, no C++ object: reading them as 64-bit words is no pun.
  const __gm__ uint64_t* from = reinterpret_cast<const __gm__ uint64_t*>(src);
#if defined(__CPU_SIM) && defined(GEMM_AR_CONTROL_PUNNED_ARGS_LOAD)
  // Negative control of tests/test_kernels_device_build.py only: the struct filled through a uint64_t* again.
  uint64_t* to = reinterpret_cast<uint64_t*>(dst);
  for (uint64_t i = 0; i < sizeof(KernelArgs) / sizeof(uint64_t); ++i) {
    to[i] = scalar_load(from + i);
  }
#else
  for (uint64_t i = 0; i < sizeof(KernelArgs) / sizeof(uint64_t); ++i) {
    set_object_word(dst, i, scalar_load(from + i));
  }
#endif
  if (dst->epoch_counter != 0) {
    // Written by a stream operation after the previous call's kernels ended: drop any cached copy, then read.
    const __gm__ int64_t* counter = reinterpret_cast<const __gm__ int64_t*>(dst->epoch_counter);
    if (site_kept(kControlCounterStale)) flush_line(counter);
    dst->epoch = static_cast<uint32_t>(scalar_load(counter));
  }
}

AICORE inline uint64_t now_us() {
#if defined(__CPU_SIM)
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
#else
  return static_cast<uint64_t>(get_sys_cnt()) / kSysCntPerUs;
#endif
}

// Called when a polling pass found nothing to do: keeps pollers from hammering GM (device) or from starving the
// simulated cores that do the work (simulator: every block is a thread on a small machine).
AICORE inline void idle_pause() {
#if defined(__CPU_SIM)
  std::this_thread::sleep_for(std::chrono::microseconds(20));
#else
  const uint64_t until = static_cast<uint64_t>(get_sys_cnt()) + 25;  // ~0.5 us
  while (static_cast<uint64_t>(get_sys_cnt()) < until) {
  }
#endif
}

// Marks a DMA store (TSTORE, atomic add) whose data a flag will publish: the simulator then requires a
// release_fence() before the next flag this core raises (sim_data_cache.hpp, ordering model). No-op on the device.
AICORE inline void note_payload_store() {
#if defined(__CPU_SIM)
  sim_cache::payload_unfenced() = true;
#endif
}

// set_flag / wait_flag as every kernel calls them: pto-isa's on the device; simulator builds also keep the
// balance per core and (src, dst, event) and complete asynchronous tile stores at the wait (sim_data_cache.hpp).
AICORE inline void set_event(pipe_t src, pipe_t dst, event_t event) {
#if GEMM_AR_SIM_MODEL
  sim_cache::note_set_flag(static_cast<int>(src), static_cast<int>(dst), static_cast<int>(event));
#endif
  set_flag(src, dst, event);
}

AICORE inline void wait_event(pipe_t src, pipe_t dst, event_t event) {
  wait_flag(src, dst, event);
#if GEMM_AR_SIM_MODEL
  sim_cache::note_wait_flag(static_cast<int>(src), static_cast<int>(dst), static_cast<int>(event));
#endif
}

// TSTORE of a tile to GM as every kernel issues it: pto-isa's on the device. Simulator builds with
// GEMM_AR_SIM_ASYNC_DMA queue it (tile and view copied: both are handles) until the next synchronisation point of
// its pipe, FIXPIPE for an accumulator tile and MTE3 otherwise (sim_data_cache.hpp).
template <pto::AtomicType Atomic = pto::AtomicType::AtomicNone, typename GmT, typename TileT>
AICORE inline void store_tile(GmT& dst, TileT& src) {
#if GEMM_AR_SIM_MODEL
  const pipe_t pipe = TileT::Loc == pto::TileType::Acc ? PIPE_FIX : PIPE_MTE3;
  sim_cache::tile_store(static_cast<int>(pipe), [dst, src]() mutable {
    if constexpr (Atomic == pto::AtomicType::AtomicNone) {
      TSTORE(dst, src);
    } else {
      TSTORE<TileT, GmT, Atomic>(dst, src);
    }
  });
#else
  if constexpr (Atomic == pto::AtomicType::AtomicNone) {
    TSTORE(dst, src);
  } else {
    TSTORE<TileT, GmT, Atomic>(dst, src);
  }
#endif
}

// Make every earlier store of this core (DMA pipes included) visible in GM before what follows: the release
// half of "payload before flag".
AICORE inline void release_fence() {
  compiler_barrier();
  pipe_barrier(PIPE_ALL);
  ddr_barrier();
#if defined(__CPU_SIM)
  __atomic_thread_fence(__ATOMIC_RELEASE);
  sim_cache::payload_unfenced() = false;
#endif
}

// Marks a load or store (DMA or scalar) that a flag seen earlier guards: the simulator requires an acquire_fence()
// between the flag and it (sim_data_cache.hpp, ordering model). No-op on the device.
AICORE inline void note_guarded_access() {
#if defined(__CPU_SIM)
  if (sim_cache::acquire_pending()) sim_cache::unfenced_accesses().fetch_add(1, std::memory_order_relaxed);
#endif
}

// After a flag was seen: no later load (DMA included) may run ahead of it.
AICORE inline void acquire_fence() {
#if defined(__CPU_SIM)
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  sim_cache::acquire_pending() = false;
#endif
  compiler_barrier();
  pipe_barrier(PIPE_ALL);
  ddr_barrier();
}

// A flag is four 32-bit words at the start of its own cache line: the call's 64-bit tag (signal_tag,
// signal_tag_high) and its complement. Data (ours from another call, or what HCCL's collectives leave in the window)
// would have to hold exactly that 128-bit pattern to pass for a flag; a word equal to the tag no longer does
// (docs/decisions/0003-epoch-tagged-flags-never-reset.md). Callers pass signal_tag(epoch); the other words follow from
// it. Release side: the caller's release_fence() made the payload visible first; the line is dropped before the store
// so a stale cached copy can never be written back over it, and written back after so the flag leaves this core.
AICORE inline void raise_flag(__gm__ uint32_t* flag, uint32_t tag, uint32_t tag_high) {
#if defined(__CPU_SIM)
  if (sim_cache::payload_unfenced()) sim_cache::unfenced_flags().fetch_add(1, std::memory_order_relaxed);
#endif
  if (site_kept(kControlFlagNotDropped)) flush_line(flag);
  scalar_store<uint32_t>(flag, tag);
  scalar_store<uint32_t>(flag + 1, tag_high);
  scalar_store<uint32_t>(flag + 2, ~tag);
  scalar_store<uint32_t>(flag + 3, ~tag_high);
  if (negative_control() != kControlDropFlush) flush_line(flag);
  ddr_barrier();
}

// Acquire side: the line is dropped first so the words come from GM, not from this core's stale copy; the caller
// issues acquire_fence() before reading the payload the flag guards.
AICORE inline bool flag_raised(__gm__ uint32_t* flag, uint32_t tag, uint32_t tag_high) {
  if (negative_control() != kControlDropInvalidate) flush_line(flag);
  if (scalar_load<uint32_t>(flag) != tag) return false;
  const bool raised = negative_control() == kControlSingleWordFlags ||
                      (scalar_load<uint32_t>(flag + 1) == tag_high && scalar_load<uint32_t>(flag + 2) == ~tag &&
                       scalar_load<uint32_t>(flag + 3) == ~tag_high);
#if defined(__CPU_SIM)
  if (raised) sim_cache::acquire_pending() = true;  // what it guards now needs an acquire_fence() first
#endif
  return raised;
}

template <typename T>
AICORE inline __gm__ T* gm_at(uint64_t base, int64_t byte_offset) {
  return reinterpret_cast<__gm__ T*>(base + static_cast<uint64_t>(byte_offset));
}

// The element type behind a DTypeCode, as the tile library spells it.
template <uint32_t Code>
struct ElemOf;
template <>
struct ElemOf<kDTypeFloat16> {
  using type = half;
};
template <>
struct ElemOf<kDTypeBFloat16> {
  using type = bfloat16_t;
};

// 2-D views of GM for TLOAD/TSTORE: rows x cols starting at ptr, the leading dimension ld in elements.
using GmShape2D = pto::Shape<1, 1, 1, pto::DYNAMIC, pto::DYNAMIC>;
using GmStride2D = pto::Stride<pto::DYNAMIC, pto::DYNAMIC, pto::DYNAMIC, pto::DYNAMIC, pto::DYNAMIC>;
template <typename T, pto::Layout L>
using Gm2D = pto::GlobalTensor<T, GmShape2D, GmStride2D, L>;

// Row-major: element (r, c) at ptr[r * ld + c].
template <typename T>
AICORE inline Gm2D<T, pto::Layout::ND> nd_view(__gm__ T* ptr, int64_t rows, int64_t cols, int64_t ld) {
  const int64_t all = rows * ld;
  return Gm2D<T, pto::Layout::ND>(ptr, GmShape2D(1, 1, 1, rows, cols), GmStride2D(all, all, all, ld, 1));
}

// Column-major: element (r, c) at ptr[c * ld + r] (weight.t() of a row-major [N, K] weight).
template <typename T>
AICORE inline Gm2D<T, pto::Layout::DN> dn_view(__gm__ T* ptr, int64_t rows, int64_t cols, int64_t ld) {
  const int64_t all = cols * ld;
  return Gm2D<T, pto::Layout::DN>(ptr, GmShape2D(1, 1, 1, rows, cols), GmStride2D(all, all, all, 1, ld));
}

// Records why this rank gave up on the call, then tells its other blocks to stop. The record is tagged with the
// call's signal tag, written last, so the host can tell a fresh record from an old one without ever clearing it.
AICORE inline void report_error(const KernelArgs& args, int32_t code, int32_t peer, int64_t item, int32_t block,
                                int32_t stage) {
  if (args.error == 0) return;
  __gm__ ErrorRecord* rec = reinterpret_cast<__gm__ ErrorRecord*>(args.error);
  const uint32_t tag = signal_tag(args.epoch);
  // rec->tag starts the record's second line: this covers every field below
  if (site_kept(kControlRecordNotDropped)) flush_line(&rec->tag);
  scalar_store<int32_t>(&rec->code, code);
  scalar_store<int32_t>(&rec->rank, args.rank);
  scalar_store<int32_t>(&rec->peer, peer);
  scalar_store<int64_t>(&rec->item, item);
  scalar_store<int32_t>(&rec->block, block);
  scalar_store<int32_t>(&rec->stage, stage);
  if (site_kept(kControlRecordFieldsUnflushed)) flush_line(&rec->tag);  // fields reach GM before the tag
  ddr_barrier();
  scalar_store<uint32_t>(&rec->tag, tag);
  if (site_kept(kControlRecordTagUnflushed)) flush_line(&rec->tag);
  ddr_barrier();
  raise_flag(&rec->abort_tag, tag, signal_tag_high(args.epoch));  // abort_tag and pad0[0..2]: one line
}

AICORE inline bool aborted(const KernelArgs& args) {
  if (args.error == 0) return false;
  __gm__ ErrorRecord* rec = reinterpret_cast<__gm__ ErrorRecord*>(args.error);
  return flag_raised(&rec->abort_tag, signal_tag(args.epoch), signal_tag_high(args.epoch));
}

// What both kernels check before touching memory. Identical on every rank for the same call, so either all ranks
// run or all stop (the comm kernel reports kErrBadArgs; the compute kernel just returns).
// Blocks this kernel was launched with. The simulator's get_block_num() is not the launch size, so there the
// configured count stands in for it.
AICORE inline int64_t launched_block_count(int64_t configured_blocks) {
#if defined(__CPU_SIM)
  return configured_blocks;
#else
  (void)configured_blocks;
  return static_cast<int64_t>(get_block_num());
#endif
}

// What even a signature-only call needs: who this rank is, how many blocks run, and where the windows are.
AICORE inline bool kernel_header_usable(const KernelArgs& args, int64_t launched_blocks, int64_t expected_blocks) {
  if (args.magic != kKernelArgsMagic) return false;
  if (args.world < 1 || args.world > kMaxWorld || args.rank < 0 || args.rank >= args.world) return false;
  if (args.compute_blocks < 1 || args.compute_blocks > kMaxComputeBlocks) return false;
  if (args.comm_blocks < 1 || args.comm_blocks > kMaxCommBlocks) return false;
  if (launched_blocks != expected_blocks) return false;
  if (args.comm_ctx == 0 || args.window_offset % kWindowAlign != 0) return false;
  return fixed_window_bytes(args.world) <= static_cast<int64_t>(args.window_bytes);
}

// Field-by-field equality of two structs of int64_t fields (kernel_args.hpp asserts their sizes).
template <typename Words>
AICORE inline bool same_words(const Words& want, const Words& got) {
  for (uint64_t i = 0; i < sizeof(Words) / sizeof(int64_t); ++i) {
    if (object_word(want, i) != object_word(got, i)) return false;
  }
  return true;
}

// The plan and the operands alone (not who runs it or where the windows are): enough to know `out` and its shape,
// so that a call refused for its header can still poison its output
// (docs/decisions/0005-bounded-waits-and-failure-reporting.md). sp_op: 0 for gemm_allreduce's kernels, else the OpKind
// whose layout the arguments must carry (gemm_ar/sequence_parallel.hpp).
AICORE inline bool kernel_operands_usable(const KernelArgs& args, uint32_t sp_op = 0) {
  const TilePlan& p = args.plan;
  if (args.magic != kKernelArgsMagic) return false;
  if (args.world < 1 || args.world > kMaxWorld || args.compute_blocks < 1 || args.compute_blocks > kMaxComputeBlocks ||
      args.comm_blocks < 1 || args.comm_blocks > kMaxCommBlocks) {
    return false;
  }
  if (args.signature_only != 0 || dtype_bytes(args.dtype) == 0) return false;
  if (args.b_layout != kBRowMajor && args.b_layout != kBTransposed) return false;
  if (p.base_m != kNpuBaseM || p.base_n != kNpuBaseN || p.base_k != kNpuBaseK || p.k_step != kNpuBaseK * kNpuKSlices ||
      p.sub_m != kNpuSubM || p.stripes != kNpuBaseM / kNpuSubM) {
    return false;
  }
  if (p.m < 1 || p.n < 1 || p.k < 1 || p.tiles != p.m_tiles * p.n_tiles) return false;
  // DMA strides are 16-bit on A2/A3.
  if (args.lda < p.k || args.lda > 65535 || args.ldb > 65535 || args.ldo < p.n) return false;
  if (args.ldb < (args.b_layout == kBTransposed ? p.k : p.n)) return false;
  if (args.a == 0 || args.b == 0 || args.out == 0 || args.scratch == 0) return false;
  // Only gemm_allreduce's comm kernel runs an epilogue: the sequence-parallel kernels refuse one.
  if (sp_op != 0 ? args.epilogue.kind != kEpilogueNone : !epilogue_args_usable(args.epilogue, p.n)) return false;
  // Only gemm_allreduce's pair has the decode variant, for one stripe of rows (with or without the epilogue).
  const bool decode = args.variant == kVariantDecode;
  if (args.variant != kVariantTiled && (!decode || sp_op != 0)) return false;
  if (decode && !decode_plannable(p.m, p.n)) return false;
  // Regions and flags are laid out relative to these: keep DMA bursts aligned and flags on their own lines.
  if (args.scratch % kWindowAlign != 0) return false;
  // Row chunks: gemm_allreduce has one, the sequence-parallel ops one per rank (sequence_parallel.hpp).
  if (sp_op == 0 ? args.chunks.count != 1 : !sp_chunks_usable(args.chunks, args.world)) return false;
  // The plan, chunks and layout must be exactly what the shared functions give for these sizes and counts.
  TilePlan plan{};
  RowChunks chunks{};
  if (!make_row_chunked_plan(&plan, &chunks, args.chunks.count, args.chunks.rows, p.n, p.k, kNpuBaseM, kNpuBaseN,
                             kNpuBaseK, kNpuKSlices, kNpuSubM)) {
    return false;
  }
  const KernelLayout layout =
      decode ? make_decode_kernel_layout(plan, dtype_bytes(args.dtype), args.world, args.compute_blocks)
      : sp_op == 0
          ? make_kernel_layout(plan, dtype_bytes(args.dtype), args.world, args.compute_blocks, args.comm_blocks)
          : make_sp_kernel_layout(plan, chunks, dtype_bytes(args.dtype), args.world, args.compute_blocks,
                                  args.comm_blocks, sp_op);
  return same_words(plan, p) && same_words(chunks, args.chunks) && same_words(layout, args.layout);
}

AICORE inline bool kernel_args_usable(const KernelArgs& args, int64_t launched_blocks, int64_t expected_blocks,
                                      uint32_t sp_op = 0) {
  if (!kernel_header_usable(args, launched_blocks, expected_blocks) || !kernel_operands_usable(args, sp_op)) {
    return false;
  }
  // Regions and flags are laid out relative to these: keep DMA bursts aligned and flags on their own lines.
  if (args.comm_ctx == 0 || args.window_offset % kWindowAlign != 0) return false;
  return args.layout.window_bytes <= static_cast<int64_t>(args.window_bytes);
}

}  // namespace device
}  // namespace gemm_ar
