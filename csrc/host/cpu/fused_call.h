// One call of the CPU fused engine: the tile protocol of docs/architecture.md §3.2 and §3.3 between the rank processes
// of one host. Compute blocks (the caller's thread and its intra-op team) multiply tiles into this rank's window and
// publish them in per-block ready queues; comm blocks (engine threads) publish drained tiles to their owners, reduce
// the subtiles this rank owns in fixed rank order, and copy every other owner's finished subtiles into the output.
// gemm_reduce_scatter is the same without the copy: tiles are owned by row chunk (the owner's output chunk), and a rank
// only waits until the owners have reduced its tiles. allgather_gemm: every rank publishes its shard of a in its
// window; comm blocks copy the peers' shards tile row by tile row while the compute blocks multiply the local rows
// first, then each peer's rows as they arrive, straight into the output.
#pragma once
#include <ATen/ATen.h>
#include <gemm_ar/layout.hpp>
#include <gemm_ar/row_chunks.hpp>
#include <gemm_ar/tile_plan.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/local_gemm.h"
#include "common/rank_agreement.h"
#include "common/row_epilogue.h"
#include "cpu/call_header.h"
#include "cpu/engine_options.h"
#include "cpu/shm_sync.h"
#include "cpu/window_set.h"

namespace gemm_ar::cpu {

// Fixed area at the start of every window, before the call's layout: the call header and the doorbells, at
// offsets that do not depend on the call's shapes (so a peer can be woken whatever call it is in).
constexpr int64_t kMainDoorbell = 64;  // doorbell of the caller's thread; comm block c uses doorbell c < 64
constexpr int64_t kDoorbellsOffset = kHeaderBytes;  // right after the call header (cpu/call_header.h)
constexpr int64_t kControlBytes = 8192;
static_assert(kDoorbellsOffset + (kMainDoorbell + 1) * kCacheLine <= kControlBytes, "control area too small");

inline Doorbell doorbell(uint8_t* window, int64_t index) {
  return Doorbell::at(window + kDoorbellsOffset + index * kCacheLine);
}

// Wakes whatever a rank may be waiting in: its comm blocks and its caller's thread.
inline void ring_every_doorbell(uint8_t* window, int64_t comm_blocks) {
  for (int64_t c = 0; c < comm_blocks; ++c) doorbell(window, c).ring();
  doorbell(window, kMainDoorbell).ring();
}

// A subtile one comm block handles: its owner reduces it, every other rank copies it once final (gemm_allreduce)
// or only waits until it is (gemm_reduce_scatter). For allgather_gemm: a tile row of a peer's shard to copy.
struct WorkItem {
  int owner;             // allgather_gemm: the rank whose shard holds the rows
  int64_t local_id;      // owner-local subtile id (allgather_gemm: the item's index)
  int64_t tile, stripe;  // allgather_gemm: tile = the tile row
  int64_t step;          // when the tile is computed: its position in its compute block's walk
};

struct CallJob {
  int64_t op = kOpGemmAllreduce;  // OpKind; gemm_allreduce_add_rmsnorm runs as gemm_allreduce
  uint32_t epoch = 0;
  int64_t bank = 0;
  TilePlan plan{};
  RowChunks chunks{};   // one chunk except for the sequence-parallel ops
  int64_t own_run = 1;  // ownership run (gemm_ar/ownership.hpp): 1 = round-robin
  // allgather_gemm: the gathered a ([M, K], this call's dtype), its element size, and per tile row whether its rows
  // are there (set with release order by the comm block that copied them); peers' rows still to copy.
  uint8_t* gathered = nullptr;
  int64_t a_elem = 0;
  std::unique_ptr<std::atomic<uint32_t>[]> rows_arrived;
  std::atomic<int64_t> copies_left{0};
  WindowLayout layout{};
  int rank = 0, world = 1;
  int64_t compute_blocks = 1, comm_blocks = 1;
  std::vector<uint8_t*> windows;  // every rank's window base (control area first)
  at::ScalarType partial_dtype = at::kFloat, out_dtype = at::kFloat;
  int64_t partial_elem = 4, out_elem = 4;
  uint8_t* out = nullptr;  // [m, n] row-major, the caller's tensor (gemm_reduce_scatter: this rank's chunks)
  // `out` starts as an addend, the residual of the in-place add+RMSNorm: every result row is added into it
  // (out = round(round(sum) + out)) instead of overwriting it; the bank keeps the plain sums peers copy from.
  bool out_holds_addend = false;
  const LocalGemm* gemm = nullptr;
  const WindowSet* window_set = nullptr;
  // Header validation happens in comm block 0 before any peer data is read; the others wait for its verdict.
  const CallArgs* call = nullptr;
  CallSignature signature{};
  std::string group_name;
  std::chrono::milliseconds timeout{0};
  bool overlap = true, ignore_epochs = false;
  // gemm_allreduce / gemm_reduce_scatter with one compute block and comm between its tiles (one core per rank):
  // the compute block multiplies the peers' tiles first and its own last, each own tile into a scratch (cache-resident
  // for 256-row tiles) reduced at once with the peers' partials (owner_last_compute.cpp); own partials skip the window.
  bool owner_reduces_in_compute = false;
  // A small gemm_allreduce there (kOneShotMaxReadBytes) with 4-byte partials: every rank sums every rank's whole
  // partial, one phase instead of reduce-scatter + all-gather (one_shot_compute.cpp); no comm block work but the
  // header check.
  bool one_shot = false;
  // One shot on the decode geometry (cpu/call_plan.h, CallPlan::decode): counted apart (decode_call_count).
  bool decode = false;
  // Set with owner_reduces_in_compute where the geometry asks for it (EngineConfig::one_product) and the call has
  // one row chunk: the compute block multiplies all of this rank's partial in one GEMM call into its window, then
  // publishes the peers' tiles and reduces its own from the window (owner_last_compute.cpp), or, in one shot, into
  // its bank before publishing every tile (one_shot_compute.cpp). Tile by tile, a product of column panels reads
  // and packs all of a once per panel, where one GEMM call packs it once.
  // allgather_gemm: where every peer's rows are in by the time this rank's are published, all rows in one GEMM call
  // (run_gather_compute).
  bool one_product = false;
  // Set with owner_reduces_in_compute where the configuration asks for it (EngineConfig::gathered_inputs) and the
  // call is a plain gemm_allreduce whose inputs fit the partial region: every rank publishes its a and b instead of
  // partials, and each owner multiplies its rows by all of them (cpu/gathered_inputs.h).
  bool gathered_inputs = false;
  // Set with owner_reduces_in_compute where this rank's output is in one of its window's slots
  // (cpu/shared_outputs.h): the owner writes its reduced rows only there, peers copy them from it, no bank.
  bool out_in_slot = false;
  // Where the output slots start in every window, their size and how many there are (0: the windows have none).
  int64_t output_slots_offset = 0, output_slot_bytes = 0, output_slots = 0;
  std::vector<std::vector<WorkItem>> items;  // per comm block
  RowEpilogue row_epilogue;                  // common/row_epilogue.h; may be empty
  // Per row block (tile row * stripes + stripe): its subtiles final on this rank; sized by plan_work.
  std::unique_ptr<std::atomic<int64_t>[]> row_block_done;

  std::atomic<bool> abort{false};
  std::atomic<int> headers_checked{0};  // 0 pending, 1 valid
  std::atomic<bool> compute_done{false};
  std::mutex error_mutex;
  std::string error;
  bool error_is_disagreement = false;  // every rank stopped before moving data: the engine stays usable

  uint8_t* region(int r, int64_t offset) const { return windows[r] + kControlBytes + offset; }
  // Records the first error, tells peers this rank gave up the call, and stops the local blocks.
  void fail(const std::string& message, bool disagreement);
  // Counts a subtile of a row block as final in the output (rows [row0, row0 + rows)); the block that completes the
  // row block runs row_epilogue on it. acq_rel: the last one sees every other block's writes to those rows.
  void subtile_final(int64_t mi, int64_t stripe, int64_t row0, int64_t rows);
};

// Plans the per-comm-block work lists (production order, own reductions first) into job.items.
void plan_work(CallJob& job);
// The compute side: every compute block's tiles, then its queue entries. Runs on the caller's thread (and its
// intra-op team); `progress` (may be empty) runs after each tile and while waiting for a peer's rows, and returns
// whether it did anything.
void run_compute_blocks(CallJob& job, const std::function<bool()>& progress);
// allgather_gemm, on the caller's thread before the blocks start: copies this rank's shard `a2d` into its window
// and into the gathered a, and tells the peers (release order per tile row).
void publish_shard(CallJob& job, const at::Tensor& a2d);
// The per-op parts of plan_work and run_compute_blocks.
void plan_gather_work(CallJob& job);                                               // allgather_call.cpp
void run_gather_compute(CallJob& job, const std::function<bool()>& progress);      // allgather_call.cpp
void run_owner_last_compute(CallJob& job, const std::function<bool()>& progress);  // owner_last_compute.cpp
// The most a rank may read from its peers' windows in a one-shot call: (world - 1) x M x N partial elements.
constexpr int64_t kOneShotMaxReadBytes = int64_t{4} << 20;
void run_one_shot_compute(CallJob& job, const std::function<bool()>& progress);  // one_shot_compute.cpp
int64_t one_shot_call_count();     // calls this process reduced in one shot (tests: the path is really taken)
int64_t decode_call_count();       // of those, the calls on the decode geometry (CallJob::decode; tests)
int64_t one_product_call_count();  // calls this process multiplied in one GEMM call (CallJob::one_product; tests)
void count_one_product_call();     // one more such call (allgather_gemm's one product counts too)
// CallJob::one_product: this rank's whole partial in one GEMM call into `partial` (rows pad_n apart, tile row mi at
// padded row mi * base_m: one row chunk), counted in one_product_call_count. The owner-last walk (into the partial
// region) and one shot (into the bank) both take it.
void multiply_whole_partial(const CallJob& job, uint8_t* partial);
// The comm side of comm block c, on a comm thread. Errors are recorded in the job (job.fail), never thrown.
void run_comm_block(CallJob& job, int64_t c);
// One compute block and one comm block on the caller's thread: comm work that is ready runs between tiles, the
// rest after the GEMM. For ranks with a single core, where a comm thread could only take turns with the GEMM.
void run_call_inline(CallJob& job);

// Waits until every rank has published its header for `epoch` and returns every signature; throws naming the
// ranks that did not arrive in time, abandoned the call, or died. `stop` ends the wait early (throws).
// `max_spins`: pauses before sleeping (bounded_wait).
std::vector<CallSignature> gather_signatures(const std::vector<uint8_t*>& windows, const WindowSet& window_set,
                                             int rank, uint32_t epoch, const CallSignature& mine,
                                             std::chrono::milliseconds timeout, Doorbell bell,
                                             const std::atomic<bool>* stop, int max_spins = kWaitSpins);

}  // namespace gemm_ar::cpu
