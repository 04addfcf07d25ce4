// The runtime arguments of the Ascend kernels (GemmComputeKernel on the cube cores, GemmCommKernel on the vector
// cores) and the byte layout of the memory they share. Read by the host (g++, csrc/host/npu), by bisheng for AICore
// and by g++ in pto-isa's CPU simulator, so: C++17, fixed-width fields only, no pointers (addresses are uint64_t so
// host and device agree on the size), trivially copyable.
//
// How a call is launched (host side):
//   1. fill a KernelArgs (plan_kernel_args() fills plan, chunks and layout: the window and scratch sizes to check;
//      the bias goes in as fp32 zero-padded to plan.pad_n),
//   2. copy it into device memory (one copy serves both kernels; it must stay alive until both finished),
//   3. launch_gemm_compute(compute_blocks, current stream, args_dev) and launch_gemm_comm(comm_blocks, comm
//      stream, args_dev) (csrc/kernels/kernel_launch.h); AscendC kernels take only pointers and scalars, which is
//      why the struct travels through device memory instead of by value,
//   4. after the comm kernel: `out` holds the result; read ErrorRecord lazily (see below).
//
// Per-call hygiene (why there is no memset and no barrier): every flag is written with the exact value
// signal_tag(epoch) (and, on the NPU, a second 32-bit tag and the complements of both: 128 bits a data word
// equal to the tag cannot forge; device_support.hpp raise_flag / flag_raised), and waited for with "== tag".
// `epoch` is a per-communicator call counter, identical on every rank, that changes every call. A flag left over
// from an earlier call (whatever its shape), or bytes HCCL's own collectives left in the window between our calls,
// do not equal the current tag, so nothing is ever reset and shapes may vary freely from call to call. Counters
// compared with epoch * world would break in both cases (a subtile not used in one call falls behind; HCCL
// overwrites the window), which is why flags are per (subtile, source) instead of one counter per subtile. The
// reduced buffer does need zeros before the atomic adds: each owner zeroes its own subtiles at the start of its
// comm kernel and then announces it per (owner, comm block) with a "prepared" flag in every rank's window; a source
// adds into an owner's subtile only after seeing it.
// Two rules keep every remote write of a call inside that call on the target rank, out of the data of other calls
// (shapes may differ, so regions move) and out of HCCL's collectives (which use the same windows between ours):
//  - entry: a rank writes into a peer's window only after it saw the peer's signature of this call in the peer's
//    own window (call_signature.hpp): the peer's comm kernel of this call has started, so its earlier stream work,
//    HCCL's included, has ended. No write of call e+1 reaches a rank still in call e or in a collective before it.
//  - exit: before a comm block leaves a call it has seen every flag of the call addressed to it (including the
//    prepared flags it did not need), so no write of call e is still in flight when the rank moves on.
// Signature slots and prepared flags have a place that does not depend on the shape, in two banks by epoch parity
// (consecutive calls must use epochs of different parity: a counter does). The signature slots need the banks: a
// rank publishes its signature of call e+1 in its own window while a peer may still read its slot of call e there
// (call_signature.hpp says why it never reads one two calls newer). The prepared flags are kept within their call
// by the two rules alone.
#pragma once
#include <cstddef>
#include <cstdint>

#include "epilogue_args.hpp"
#include "fn.hpp"
#include "layout.hpp"
#include "ownership.hpp"
#include "partition.hpp"
#include "row_chunks.hpp"
#include "tile_plan.hpp"

namespace gemm_ar {

constexpr uint32_t kKernelArgsMagic = 0x36524147u;  // "GAR6": bumped whenever KernelArgs or its meaning changes
                                                    // (GAR4: row chunks; GAR5: the epilogue at the end; GAR6: variant)
constexpr int64_t kMaxWorld = 64;                   // HCCL_MAX_RANK_NUM: windowsIn[] has 64 entries
constexpr int64_t kMaxCommBlocks = 64;              // bound on KernelArgs::comm_blocks (sizes the prepared region)
constexpr int64_t kMaxComputeBlocks = 64;           // bound on KernelArgs::compute_blocks
constexpr int64_t kFlagStride = kCacheLine;         // one flag per cache line: AICore flushes whole lines
constexpr int64_t kQueueSlotBytes = 32;             // ready-queue slot: tile id, ~id, 2 spare words, then a flag
// The call signature every rank publishes in its own window for its peers to read before any data moves: the host's
// CallSignature words (common/rank_agreement.h), word 0 the rank's own error code (0: arguments valid). The kernel
// compares them word by word and knows no other meaning.
constexpr int64_t kSignatureWords = 16;
// A signature slot: the flag's line, then the words, then their complements (a torn or forged slot fails both).
constexpr int64_t kSignatureSlotBytes = kFlagStride + 2 * kSignatureWords * static_cast<int64_t>(sizeof(int64_t));
// Word 0 a rank publishes when its kernel finds its own KernelArgs unusable (host codes are small integers).
constexpr int64_t kSignatureKernelRejected = 1001;

// NPU tile sizes (docs/architecture.md §3.1); the kernels are compiled for exactly these.
constexpr int64_t kNpuBaseM = 128;
constexpr int64_t kNpuBaseN = 256;
constexpr int64_t kNpuBaseK = 64;
constexpr int64_t kNpuKSlices = 4;
constexpr int64_t kNpuSubM = 64;

// How gemm_allreduce's kernel pair moves a call's data (KernelArgs::variant). The compute kernel is the same for
// both; the comm kernel and the window layout differ.
enum KernelVariant : uint32_t {
  kVariantTiled = 0,  // reduce-scatter by atomic adds into tile owners, then all-gather (make_kernel_layout)
  // Decode (one-shot, small M): every rank pushes its whole partial product into every peer's window and sums all
  // partials itself in rank order, so every rank gets the same bits (make_decode_kernel_layout,
  // docs/ascend.md "Decode").
  kVariantDecode = 1,
};
constexpr int64_t kDecodeMaxM = kNpuSubM;  // decode: at most one stripe of rows (the partial moves as one subtile)
constexpr int64_t kDecodeMaxTiles = 256;   // decode: column tiles per call (N <= 65536; comm blocks track each)

enum DTypeCode : uint32_t {
  kDTypeFloat16 = 1,
  kDTypeBFloat16 = 2,
};

// Memory order of b (the logical [K, N] weight).
enum BLayoutCode : uint32_t {
  kBRowMajor = 0,  // b[k * ldb + n]: a plain [K, N] tensor
  // b[n * ldb + k]: weight.t() of an nn.Linear weight [N, K] ("DN" in pto-isa's gemm_ar example), never copied
  kBTransposed = 1,
};

// The device context HCCL returns on MESH topologies (HcclAllocComResourceByTiling): the kernels read rankId,
// rankNum and windowsIn[] from it. On RING topologies the host assembles one in device memory with this layout.
struct CommContext {
  uint64_t work_space;
  uint64_t work_space_size;
  uint32_t rank_id;
  uint32_t rank_num;
  uint64_t win_size;
  uint64_t windows_in[kMaxWorld];
  uint64_t windows_out[kMaxWorld];
};

// Where everything lives. Window offsets are relative to windows_in[rank] + KernelArgs::window_offset and are the
// same on every rank; scratch offsets are relative to KernelArgs::scratch (plain device memory, this rank only).
struct KernelLayout {
  // window (remote ranks write here, except into the signature slots, which they only read)
  int64_t prepared_offset, prepared_bytes;    // [epoch & 1][owner][comm block] flags: "my subtiles are zeroed";
                                              // first, sized by world and kMaxCommBlocks only: never moves
  int64_t signature_offset, signature_bytes;  // [epoch & 1][source] signature slots: rank `source` writes its own in
                                              // its own window, read by peers; sized by world: never moves
  int64_t reduced_offset, reduced_bytes;      // pad_m x pad_n output dtype: RS atomic adds, then AG copies
  int64_t contrib_offset, contrib_bytes;      // [owner-local subtile][source] flags: "source added its part"
  int64_t arrival_offset, arrival_bytes;      // [tile * stripes + stripe] flags: "the owner delivered this subtile"
  int64_t window_bytes;                       // total needed from window_offset on
  // scratch (local only)
  int64_t partial_offset, partial_bytes;  // pad_m x pad_n output dtype: this rank's own a @ b
  int64_t queue_offset, queue_stride;     // per compute block: slot j = {tile id, tag} of the j-th tile it stored
  int64_t queue_capacity;                 // slots per queue (max tiles of one compute block)
  int64_t scratch_bytes;                  // total scratch needed
};

// The only thing that outlives a call. Lives in plain device memory the host owns (never in the window); the
// host may keep one per communicator and read it after synchronising, or whenever it wants to check.
// A record is valid for call `epoch` when tag == signal_tag(epoch): no reset needed between calls.
struct ErrorRecord {
  uint32_t abort_tag;  // set to the call's tag by the first block that fails: the others stop early
  uint32_t pad0[15];   // own cache line
  uint32_t tag;        // signal_tag(epoch) of the failed call, written last
  int32_t code;        // ErrorCode
  int32_t rank;        // the rank that gave up
  int32_t peer;        // the rank it waited for (-1: none / local)
  int64_t item;        // tile, subtile or queue slot it waited for
  int32_t block;       // comm block index
  int32_t stage;       // 0 compute, 1 comm
  uint32_t pad1[8];
};

enum ErrorCode : int32_t {
  kErrNone = 0,
  kErrBadArgs = 1,            // magic/sizes/ranks inconsistent: nothing was touched
  kErrTimeoutCompute = 2,     // waited too long for this rank's own compute kernel (ready queue `item`)
  kErrTimeoutPrepare = 3,     // owner `peer` never announced its zeroed subtiles for this call
  kErrTimeoutReduce = 4,      // source `peer` never added its part of owner-local subtile `item`
  kErrTimeoutGather = 5,      // owner `peer` never delivered global subtile `item`
  kErrAborted = 6,            // another block of this rank failed first
  kErrQueueCorrupt = 7,       // a ready-queue slot carried an unexpected tile id (`item` = queue << 32 | slot)
  kErrSignatureMismatch = 8,  // rank `peer` called with another signature (`item` = first differing word; -2: its
                              // slot stayed torn)
  kErrPeerRejected = 9,       // rank `peer` (possibly this one) rejected its arguments (`item` = its error code)
  // The sequence-parallel kernels (gemm_ar/sequence_parallel.hpp); numbered apart so the list above can grow.
  kErrTimeoutRows = 20,      // allgather compute: shard `peer`'s tile row `item` never arrived in the gathered a
  kErrTimeoutConsumed = 21,  // allgather: rank `peer` never finished pulling this rank's shard (comm block `item`)
};

struct KernelArgs {
  uint32_t magic;     // kKernelArgsMagic
  uint32_t dtype;     // DTypeCode of a, b, bias, out (accumulation is fp32)
  uint32_t b_layout;  // BLayoutCode
  uint32_t epoch;     // per-communicator call counter: same on every rank, +1 every call (parity alternates)

  uint64_t a;             // [M, K], a[m * lda + k]
  uint64_t b;             // see b_layout
  uint64_t bias;          // FLOAT32 [plan.pad_n], zero past N (the host converts and pads), or 0: added once, by
                          // rank bias_rank, in the cube's fp32 accumulator (A2/A3's bias table takes fp32, not
                          // bf16; padding lets every tile load whole 32-byte blocks)
  uint64_t out;           // [M, N], out[m * ldo + n]: the result, written by the comm kernel on every rank
  int64_t lda, ldb, ldo;  // row strides in elements

  uint64_t comm_ctx;       // device address of the CommContext
  uint64_t window_offset;  // where our region starts in every rank's windows_in[] (same on every rank; a
                           // multiple of kWindowAlign)
  uint64_t window_bytes;   // bytes available from window_offset on (checked against layout.window_bytes)
  uint64_t scratch;        // device address of this rank's scratch (layout.scratch_bytes, kWindowAlign-aligned)
  uint64_t error;          // device address of this rank's ErrorRecord
  uint64_t epoch_counter;  // 0, or the device address of an int64 whose low 32 bits replace `epoch`: the host adds
                           // 1 to it on the stream after each call, so calls replayed from a captured graph (whose
                           // KernelArgs bytes are replayed unchanged) still get a new epoch every call

  int32_t rank, world;                 // must match comm_ctx->rank_id / rank_num
  int32_t compute_blocks;              // P <= kMaxComputeBlocks: launch block count of GemmComputeKernel
  int32_t comm_blocks;                 // Q <= kMaxCommBlocks: launch block count of GemmCommKernel (all must run
                                       // concurrently)
  int32_t bias_rank;                   // which rank adds the bias (normally 0)
  uint32_t wait_timeout_us;            // a wait without progress for this long fails the call (ErrorRecord); 0 = 30 s
  uint32_t signature_only;             // 1: publish and check the signature, move no data (a rank that rejected its
                                       // arguments, or M = 0); only the fields up to here and `signature` are read
  uint32_t variant;                    // KernelVariant (gemm_allreduce's pair only; the sequence-parallel pairs refuse
                                       // anything but kVariantTiled); the host also puts it in the signature
  int64_t signature[kSignatureWords];  // this rank's call signature (see kSignatureWords)

  TilePlan plan;          // make_row_chunked_plan(chunks.count, chunks.rows, n, k, kNpuBaseM, kNpuBaseN,
                          // kNpuBaseK, kNpuKSlices, kNpuSubM)
  RowChunks chunks;       // gemm_allreduce: one chunk (the plain tile plan); the sequence-parallel ops: one
                          // chunk per rank (gemm_ar/sequence_parallel.hpp)
  KernelLayout layout;    // make_kernel_layout / make_decode_kernel_layout / make_sp_kernel_layout
  EpilogueArgs epilogue;  // gemm_allreduce's comm kernel only (epilogue_args.hpp); zero (none) otherwise
};

static_assert(sizeof(TilePlan) % sizeof(int64_t) == 0 && sizeof(RowChunks) % sizeof(int64_t) == 0 &&
                  sizeof(KernelLayout) % sizeof(int64_t) == 0,
              "the kernels compare plans, chunks and layouts 64-bit word by 64-bit word");

GEMM_AR_FN int64_t dtype_bytes(uint32_t dtype) { return (dtype == kDTypeFloat16 || dtype == kDTypeBFloat16) ? 2 : 0; }

// The value every flag of call `epoch` carries. A bijection on uint32 (so two different epochs never share a tag)
// that avoids small integers and all-zero/all-one words, which stale memory is most likely to contain.
GEMM_AR_FN uint32_t signal_tag(uint32_t epoch) {
  uint32_t t = (epoch * 0x9E3779B1u) ^ 0x5A3C96E1u;
  if (t == 0u || t == 0xFFFFFFFFu) t ^= 0x00010001u;
  return t;
}

// The upper half of an NPU flag's 64-bit tag: another bijection of the epoch, so the pair differs from call to call
// in both halves.
GEMM_AR_FN uint32_t signal_tag_high(uint32_t epoch) { return (epoch * 0x85EBCA6Bu) ^ 0xC2B2AE35u; }

// The regions whose place depends on the world size only (prepared flags, signature slots): what a
// signature-only call needs, and where every call's shape-dependent regions start.
GEMM_AR_FN int64_t prepared_region_bytes(int64_t world) { return 2 * world * kMaxCommBlocks * kFlagStride; }
GEMM_AR_FN int64_t signature_region_offset(int64_t world) {
  return align_up(prepared_region_bytes(world), kWindowAlign);
}
GEMM_AR_FN int64_t signature_region_bytes(int64_t world) { return 2 * world * kSignatureSlotBytes; }
GEMM_AR_FN int64_t fixed_window_bytes(int64_t world) {
  return align_up(signature_region_offset(world) + signature_region_bytes(world), kWindowAlign);
}
// The slot where rank `source` publishes its signature of call `epoch`: in its own window, read by peers from there
// (banked by parity: it may publish call e+1 while a peer still reads its slot of call e).
GEMM_AR_FN int64_t signature_slot_offset(int64_t world, uint32_t epoch, int64_t source) {
  const int64_t bank = static_cast<int64_t>(epoch & 1u);
  return signature_region_offset(world) + (bank * world + source) * kSignatureSlotBytes;
}

// The region sizes in which the kernel pairs differ; place_kernel_layout places them, and what every pair has in
// common, one after another.
struct LayoutRegionBytes {
  int64_t reduced, contrib, arrival;  // the window regions of KernelLayout
  int64_t scratch_head;               // scratch before the partial products (the allgather's gathered a)
};

// Places the fixed window regions (prepared flags, signatures), then `r`'s window regions; in the scratch r's head,
// then the pad_m x pad_n partial products of every plan tile and one ready queue per compute block, sized for the
// block that gets the most of the plan's tiles.
GEMM_AR_FN KernelLayout place_kernel_layout(const TilePlan& plan, int64_t elem_bytes, int64_t world,
                                            int64_t compute_blocks, const LayoutRegionBytes& r) {
  KernelLayout k{};
  int64_t at = 0;
  k.prepared_offset = at;
  k.prepared_bytes = prepared_region_bytes(world);
  k.signature_offset = signature_region_offset(world);
  k.signature_bytes = signature_region_bytes(world);
  at = fixed_window_bytes(world);
  k.reduced_offset = at;
  k.reduced_bytes = r.reduced;
  at = align_up(at + k.reduced_bytes, kWindowAlign);
  k.contrib_offset = at;
  k.contrib_bytes = r.contrib;
  at = align_up(at + k.contrib_bytes, kWindowAlign);
  k.arrival_offset = at;
  k.arrival_bytes = r.arrival;
  at = align_up(at + k.arrival_bytes, kWindowAlign);
  k.window_bytes = at;

  at = align_up(r.scratch_head, kWindowAlign);
  k.partial_offset = at;
  k.partial_bytes = plan.pad_m * plan.pad_n * elem_bytes;
  at = align_up(at + k.partial_bytes, kWindowAlign);
  k.queue_offset = at;
  k.queue_capacity = max_block_items(plan.tiles, compute_blocks);
  k.queue_stride = align_up(k.queue_capacity * kQueueSlotBytes, kCacheLine);
  at = align_up(at + compute_blocks * k.queue_stride, kWindowAlign);
  k.scratch_bytes = at;
  return k;
}

// Bytes of the contribution flags when tiles are owned in runs of `run` (ownership.hpp): one flag per owner-local
// subtile and source, sized for the rank that owns the most.
GEMM_AR_FN int64_t contrib_region_bytes(const TilePlan& plan, int64_t world, int64_t run) {
  return run_max_owned_subtile_count(plan.tiles, world, plan.stripes, run) * world * kFlagStride;
}

GEMM_AR_FN KernelLayout make_kernel_layout(const TilePlan& plan, int64_t elem_bytes, int64_t world,
                                           int64_t compute_blocks, int64_t comm_blocks) {
  // The prepared region is sized by kMaxCommBlocks, not by comm_blocks, so that its place never depends on the
  // call (see the top of this file); the parameter stays so that every caller passes the same counts.
  (void)comm_blocks;
  LayoutRegionBytes r{};
  r.reduced = plan.pad_m * plan.pad_n * elem_bytes;  // every tile: the owners' sums, then everybody's copies
  r.contrib = contrib_region_bytes(plan, world, 1);  // tiles dealt round-robin
  r.arrival = plan.tiles * plan.stripes * kFlagStride;
  r.scratch_head = 0;
  return place_kernel_layout(plan, elem_bytes, world, compute_blocks, r);
}

// The decode variant's regions (kVariantDecode): `reduced` holds the pushed partials [source][m][pad_n] (a rank's own
// slot is used only with the add+RMSNorm epilogue, which reads every partial from there; without it a rank reads its
// own from its scratch), `contrib` the pushed flags [tile][source] ("source's
// partial of tile t is in this window"), no arrival flags. The scratch is the tiled variant's: the compute kernel is
// the same.
GEMM_AR_FN KernelLayout make_decode_kernel_layout(const TilePlan& plan, int64_t elem_bytes, int64_t world,
                                                  int64_t compute_blocks) {
  LayoutRegionBytes r{};
  r.reduced = world * plan.m * plan.pad_n * elem_bytes;
  r.contrib = plan.tiles * world * kFlagStride;
  r.arrival = 0;
  r.scratch_head = 0;
  return place_kernel_layout(plan, elem_bytes, world, compute_blocks, r);
}

// Whether a gemm_allreduce call (with or without the add+RMSNorm epilogue) of these sizes fits the decode variant.
GEMM_AR_FN bool decode_plannable(int64_t m, int64_t n) {
  return m >= 1 && m <= kDecodeMaxM && n >= 1 && n <= kDecodeMaxTiles * kNpuBaseN;
}

// Byte offsets of single flags, relative to the window region / scratch.
GEMM_AR_FN int64_t prepared_flag_offset(const KernelLayout& k, uint32_t epoch, int64_t owner, int64_t comm_block,
                                        int64_t world) {
  const int64_t bank = static_cast<int64_t>(epoch & 1u);
  return k.prepared_offset + ((bank * world + owner) * kMaxCommBlocks + comm_block) * kFlagStride;
}
GEMM_AR_FN int64_t contrib_flag_offset(const KernelLayout& k, int64_t local_subtile, int64_t source, int64_t world) {
  return k.contrib_offset + (local_subtile * world + source) * kFlagStride;
}
GEMM_AR_FN int64_t arrival_flag_offset(const KernelLayout& k, int64_t tile, int64_t stripe, int64_t stripes) {
  return k.arrival_offset + (tile * stripes + stripe) * kFlagStride;
}
GEMM_AR_FN int64_t queue_slot_offset(const KernelLayout& k, int64_t queue, int64_t slot) {
  return k.queue_offset + queue * k.queue_stride + slot * kQueueSlotBytes;
}

// What every kernel pair needs of *args before it can be planned: a dtype, a world HCCL can have, block counts the
// kernels take.
GEMM_AR_FN bool kernel_counts_plannable(const KernelArgs* args) {
  if (args == nullptr || dtype_bytes(args->dtype) == 0) return false;
  if (args->world < 1 || args->world > kMaxWorld) return false;
  if (args->compute_blocks < 1 || args->compute_blocks > kMaxComputeBlocks) return false;
  return args->comm_blocks >= 1 && args->comm_blocks <= kMaxCommBlocks;
}

// Fills plan and chunks of *args at the NPU tile sizes: `count` row chunks of `rows` rows each (row_chunks.hpp).
GEMM_AR_FN bool plan_npu_tiles(KernelArgs* args, int64_t count, int64_t rows, int64_t n, int64_t k) {
  return make_row_chunked_plan(&args->plan, &args->chunks, count, rows, n, k, kNpuBaseM, kNpuBaseN, kNpuBaseK,
                               kNpuKSlices, kNpuSubM);
}

// Fills plan, chunks (one) and layout of *args from the sizes and args->dtype/world/compute_blocks/comm_blocks;
// false when the kernels cannot run this call (the host then takes another path): an empty problem (m, n or
// k == 0: nothing to pipeline, and k == 0 would leave the accumulator unwritten), bad block counts, or a world
// HCCL cannot have.
GEMM_AR_FN bool plan_kernel_args(KernelArgs* args, int64_t m, int64_t n, int64_t k) {
  if (!kernel_counts_plannable(args) || m <= 0 || n <= 0 || k <= 0) return false;
  if (!plan_npu_tiles(args, 1, m, n, k)) return false;
  args->variant = kVariantTiled;
  args->layout =
      make_kernel_layout(args->plan, dtype_bytes(args->dtype), args->world, args->compute_blocks, args->comm_blocks);
  return true;
}

// plan_kernel_args for the decode variant (variant set, decode layout); false also when the sizes do not fit it.
GEMM_AR_FN bool plan_decode_kernel_args(KernelArgs* args, int64_t m, int64_t n, int64_t k) {
  if (!kernel_counts_plannable(args) || !decode_plannable(m, n) || k <= 0) return false;
  if (!plan_npu_tiles(args, 1, m, n, k)) return false;
  args->variant = kVariantDecode;
  args->layout = make_decode_kernel_layout(args->plan, dtype_bytes(args->dtype), args->world, args->compute_blocks);
  return true;
}

}  // namespace gemm_ar
