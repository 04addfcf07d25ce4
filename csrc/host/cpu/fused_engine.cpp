#include "cpu/fused_engine.h"

#include <c10/util/Exception.h>
#include <gemm_ar/protocol.hpp>

#include <unistd.h>

#include <cstdlib>
#include <optional>

#include "common/current_op.h"
#include "common/settings.h"
#include "common/test_hooks.h"
#include "cpu/call_header.h"
#include "cpu/call_plan.h"
#include "cpu/call_waits.h"
#include "cpu/gathered_inputs.h"
#include "cpu/host_identity.h"
#include "cpu/output_pool.h"
#include "cpu/packed_b_panels.h"
#include "cpu/store_exchange.h"

namespace gemm_ar::cpu {
namespace {

constexpr size_t kGrowthQuantum = size_t{1} << 20;
constexpr int64_t kSlotAlignment = 4096;

// Raises a ValueError for diagnoses that every rank reaches alike, a RuntimeError for everything else.
[[noreturn]] void raise(const std::string& message, bool disagreement) {
  if (disagreement) TORCH_CHECK_VALUE(false, message);
  TORCH_CHECK(false, message);
}

// What decides how a call uses the windows, beyond the call itself: ranks must agree on it (a rank reducing in one
// shot and a rank reducing in two phases would read each other's stale data). Every engine option, since a tuning
// run of a forced tile family takes a configuration that the agreement does not compare field by field (it compares
// the rules' one) and tune_tile_family decides the candidates `auto` races; whether a tile comes from the environment
// (it turns the geometry rules and the forced families off); the output slots per window.
int64_t engine_mode_bits() {
  return engine_options_signature() | int64_t{tile_from_environment()} << kEngineOptionSignatureBits |
         int64_t{shared_output_slots()} << (kEngineOptionSignatureBits + 1);
}

// The row chunks of a sequence-parallel call (row_chunks.hpp): a's rows from the sharded dim on make one chunk of
// one rank; the dims before it repeat the pattern (3-D a sharded along dim 1: one chunk per (batch, rank)).
// `local`: out_shape is one rank's shard (allgather_gemm) rather than the whole (gemm_reduce_scatter).
RowChunks sequence_chunks(const CallArgs& call, int world, bool local) {
  const auto& shape = call.out_shape;
  int64_t rows = local ? shape[call.shard_dim] : shape[call.shard_dim] / world;
  for (size_t d = call.shard_dim + 1; d + 1 < shape.size(); ++d) rows *= shape[d];
  const int64_t chunks_here = rows > 0 ? call.m / rows : 0;
  return RowChunks{local ? chunks_here * world : chunks_here, rows, 0};
}

// The engine's configuration of `call` (call_geometry.h), with the rows of a sequence-parallel call's chunks.
EngineConfig config_of(const CallArgs& call, int world, int64_t family) {
  // A call this rank rejected (bad arguments) still agrees, to tell its peers: its shape may be incomplete.
  const int64_t dims = static_cast<int64_t>(call.out_shape.size());
  const bool sequence_parallel = (call.op == kOpGemmReduceScatter || call.op == kOpAllgatherGemm) &&
                                 call.shard_dim >= 0 && call.shard_dim + 1 < dims;
  const int64_t chunk_rows = sequence_parallel ? sequence_chunks(call, world, call.op == kOpAllgatherGemm).rows : 0;
  return call_config(call.op, call.m, call.k, call.n, call.dtype, world, family, chunk_rows);
}

}  // namespace

FusedEngine::~FusedEngine() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& thread : threads_) thread.join();
}

FusedEngine::FusedEngine(c10d::ProcessGroup& group)
    : group_name_(group.getGroupName()), rank_(group.getRank()), world_(group.getSize()) {
  auto store = group.getStore();
  if (!store) {
    unavailable_ = "process group '" + group_name_ + "' has no store to set up shared windows";
    return;
  }
  const std::string me = host_identity();
  // TORCH_GEMM_AR_CPU_ENGINE=0 on any rank turns the engine off for the whole group (as if the ranks were on
  // several hosts: `auto` then picks a portable algorithm), so it rides on the exchange every rank makes anyway.
  const bool enabled = env_int(Setting::kCpuEngine, 1, 0, 1) != 0;
  auto values =
      exchange_over_store(*store, "gemm_ar/hosts", rank_, world_,
                          me + "|" + (enabled ? "1" : "0") + "|" + std::to_string(getpid()), wait_timeout(), nullptr);
  std::vector<pid_t> pids(world_);
  for (int r = 0; r < world_; ++r) {
    const auto bar = values[r].rfind('|');
    pids[r] = static_cast<pid_t>(std::stol(values[r].substr(bar + 1)));
    values[r].resize(bar);
    if (values[r].back() == '0' && unavailable_.empty()) {
      unavailable_ =
          "the CPU fused engine is turned off by TORCH_GEMM_AR_CPU_ENGINE=0 (on rank " + std::to_string(r) + ")";
    }
    values[r].resize(values[r].size() - 2);  // drop "|1" / "|0": the host identity remains
    if (values[r] != me && unavailable_.empty()) {
      unavailable_ = "the ranks of group '" + group_name_ + "' are not all on one host (rank " + std::to_string(r) +
                     " is elsewhere); the CPU fused engine needs shared memory";
    }
  }
  if (!unavailable_.empty()) return;
  windows_ = std::make_unique<WindowSet>(std::move(store), rank_, world_, std::move(pids));
  // Only the control area until the first fused call says how much it needs.
  windows_->resize(kControlBytes, /*round=*/0, wait_timeout(),
                   [this] { windows_->check_peers_alive("while setting up windows"); });
}

std::string FusedEngine::unavailable_reason() const {
  if (!unavailable_.empty()) return unavailable_;
  if (!poisoned_.empty()) return "the fused engine of this group stopped after an earlier failure (" + poisoned_ + ")";
  return "";
}

std::string FusedEngine::where() const {
  return " [rank " + std::to_string(rank_) + " of group '" + group_name_ + "', call " + std::to_string(epoch_) + "]";
}

std::vector<uint8_t*> FusedEngine::bases() const {
  std::vector<uint8_t*> out(world_);
  for (int r = 0; r < world_; ++r) out[r] = windows_->base(r);
  return out;
}

void FusedEngine::ring_peers() const {
  for (int r = 0; r < world_; ++r) {
    if (r != rank_) ring_every_doorbell(windows_->base(r), config_.comm_blocks);
  }
}

std::vector<CallSignature> FusedEngine::agree(const CallArgs& call, Algorithm chosen) {
  config_family_ = fused_family_of(chosen);
  config_ = config_of(call, world_, config_family_);
  ++epoch_;
  signature_ = call_signature(call, chosen);
  // A tuning call (auto, resolved after the agreement) may run fused: its engine configuration is compared too (the
  // rules' one; a tuning run of a forced tile family takes that family's in run(), the same on every rank because
  // every input of call_config, the geometry options included, is in this signature).
  if (is_fused(chosen) || chosen == Algorithm::Auto) {
    signature_[kSigTileM] = config_.base_m;
    signature_[kSigTileN] = config_.base_n;
    signature_[kSigSubM] = config_.sub_m;
    signature_[kSigComputeBlocks] = config_.compute_blocks;
    // 0: comm between tiles on the caller's thread (TORCH_GEMM_AR_COMM_THREADS=0). Ranks must agree on it, not only
    // on the block count: small calls there reduce in one shot, which a rank with a comm thread does not expect.
    signature_[kSigCommBlocks] = config_.comm_inline ? 0 : config_.comm_blocks;
    signature_[kSigEngineMode] = engine_mode_bits();
  }
  // The header keeps two calls: this one overwrites call e - 2's, which a peer reads until it starts e - 1. A rank
  // that left its earlier calls at once (its own arguments rejected) could otherwise be two calls ahead of a peer.
  // (Call 1 has no predecessor; started_call() holds on a zeroed header, so after the counter wraps calls 0 and 1 pass
  // at once.)
  if (epoch_ > 1 && !test_hooks::skip_previous_call_wait()) {
    try {
      wait_for_peers_to_start(bases(), epoch_);
    } catch (const std::exception& e) {  // a peer late or dead: tell the others this rank gave up this call
      publish_abort(windows_->base(rank_), epoch_);
      ring_peers();
      raise(e.what(), false);
    }
  }
  publish_header(windows_->base(rank_), epoch_, signature_);
  ring_peers();
  if (!call.error.empty()) raise(call.error + where(), agreement_problem_is_value_error({}, call));
  if (is_fused(chosen) && call.m > 0) return {};
  return check_every_signature(call);
}

std::vector<CallSignature> FusedEngine::check_every_signature(const CallArgs& call) {
  std::vector<CallSignature> all;
  try {
    // A tuning call leaves the agreement with every rank awake, so its timed run starts together (kAlignSpins).
    all = gather_signatures(bases(), *windows_, rank_, epoch_, signature_, wait_timeout(),
                            doorbell(windows_->base(rank_), kMainDoorbell), nullptr,
                            call.tune_step >= 0 ? kAlignSpins : kWaitSpins);
  } catch (const std::exception& e) {  // a peer late, dead or gone: tell the others this rank gave up
    publish_abort(windows_->base(rank_), epoch_);
    ring_peers();
    raise(e.what(), false);
  }
  const std::string problem = diagnose_signatures(all, rank_, call, group_name_);
  if (!problem.empty()) raise(problem, agreement_problem_is_value_error(all, call));
  return all;
}

namespace {

// Region sizes in bytes are what matters: express a call's needs as a one-row layout of bytes.
LayoutParams byte_capacity(const LayoutParams& p) {
  LayoutParams c = p;
  c.pad_m = 1;
  c.pad_n = std::max(p.pad_m * p.pad_n * p.elem_bytes, p.pad_m * p.pad_n * p.partial_elem_bytes);
  c.elem_bytes = 1;
  c.partial_elem_bytes = 1;
  return c;
}

bool fits(const LayoutParams& call, const LayoutParams& capacity) {
  const LayoutParams c = byte_capacity(call);
  return c.pad_n <= capacity.pad_n && c.tiles <= capacity.tiles &&
         c.max_owned_subtiles <= capacity.max_owned_subtiles && c.queue_capacity <= capacity.queue_capacity &&
         c.world == capacity.world && c.compute_blocks == capacity.compute_blocks &&
         c.comm_blocks == capacity.comm_blocks;
}

// The next capacity: at least the call's needs and the old capacity, with headroom so that slowly growing shapes
// do not regrow every call. Deterministic, so every rank picks the same.
LayoutParams grown_capacity(const LayoutParams& call, const LayoutParams& old) {
  LayoutParams c = byte_capacity(call);
  const bool same_blocks = old.compute_blocks == c.compute_blocks && old.comm_blocks == c.comm_blocks;
  if (same_blocks && old.world == c.world) {
    c.pad_n = std::max(c.pad_n, 2 * old.pad_n);
    c.tiles = std::max(c.tiles, 2 * old.tiles);
    c.max_owned_subtiles = std::max(c.max_owned_subtiles, 2 * old.max_owned_subtiles);
    c.queue_capacity = std::max(c.queue_capacity, 2 * old.queue_capacity);
  }
  return c;
}

// Where the output slots start in every window: after the regions, page-aligned.
int64_t slots_offset_of(const WindowLayout& regions) {
  return align_up(kControlBytes + regions.total_bytes, kSlotAlignment);
}

}  // namespace

void FusedEngine::grow(const LayoutParams& need, int64_t slot_bytes) {
  const LayoutParams capacity = fits(need, capacity_) ? capacity_ : grown_capacity(need, capacity_);
  const WindowLayout regions = make_window_layout(capacity);
  // Slots grow like the regions (at least doubling), page-aligned, in the number agreed for this call
  // (engine_mode_bits): every rank derives the same sizes. They stay with these windows.
  const int64_t slots_offset = slots_offset_of(regions);
  const int slot_count = shared_output_slots();
  const int64_t next_slot_bytes = slot_count == 0 ? 0
                                  : slot_bytes > slot_bytes_
                                      ? align_up(std::max(slot_bytes, 2 * slot_bytes_), kSlotAlignment)
                                      : slot_bytes_;
  const size_t bytes = static_cast<size_t>(next_slot_bytes > 0 ? slots_offset + slot_count * next_slot_bytes
                                                               : kControlBytes + regions.total_bytes);
  const size_t rounded = (bytes + kGrowthQuantum - 1) / kGrowthQuantum * kGrowthQuantum;
  // Every rank has agreed on this call before growing (run() checked the headers), so all of them grow; while
  // waiting, a peer that died or gave up ends the wait at once.
  const std::vector<uint8_t*> old = bases();
  auto poll = [&] {
    windows_->check_peers_alive("while growing the shared windows");
    for (int r = 0; r < world_; ++r) {
      if (r != rank_ && abandoned(old[r], epoch_)) {
        windows_->check_peers_alive("while growing the shared windows");  // name a dead rank behind the abandon
        raise(current_op() + ": rank " + std::to_string(r) + " abandoned call " + std::to_string(epoch_) +
                  " (see that rank's error)" + where(),
              true);
      }
    }
  };
  // Always fresh windows when the regions move: a slower peer may still read the old ones (its own mapping).
  windows_->resize(rounded, epoch_, wait_timeout(), poll);
  capacity_ = capacity;
  regions_ = regions;
  // Tensors in the old slots keep the old window mapped and free their slot there.
  slot_bytes_ = next_slot_bytes;
  slot_count_ = next_slot_bytes > 0 ? slot_count : 0;
  slots_.reset();
  if (slot_count_ > 0) {
    slots_ = std::make_unique<SharedOutputSlots>(windows_->segment(rank_), slots_offset, slot_bytes_, slot_count_);
  }
  publish_header(windows_->base(rank_), epoch_, signature_);  // the new windows start zeroed
  ring_peers();
}

void FusedEngine::start_comm_threads(int64_t count) {
  while (static_cast<int64_t>(threads_.size()) < count) {
    const int64_t c = static_cast<int64_t>(threads_.size());
    threads_.emplace_back([this, c] { comm_thread_main(c); });
  }
}

void FusedEngine::comm_thread_main(int64_t c) {
  uint64_t seen = 0;
  for (;;) {
    CallJob* job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return job_generation_ != seen || stopping_; });
      if (stopping_) return;  // only set once no call runs (the engine is being destroyed)
      seen = job_generation_;
      // A thread beyond this call's comm blocks must not touch the job: it may already be gone.
      if (c >= running_blocks_) continue;
      job = job_;
    }
    run_comm_block(*job, c);
    std::lock_guard<std::mutex> lock(mutex_);
    if (--running_ == 0) finished_.notify_all();
  }
}

void FusedEngine::run_with_comm_threads(CallJob& job) {
  start_comm_threads(job.comm_blocks);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &job;
    running_ = running_blocks_ = job.comm_blocks;
    ++job_generation_;
  }
  wake_.notify_all();
  try {
    run_compute_blocks(job, nullptr);
  } catch (const std::exception& e) {
    job.fail((current_op() + ": the local GEMM failed: ") + e.what() + where(), false);
  }
  job.compute_done.store(true, std::memory_order_release);
  for (int64_t c = 0; c < job.comm_blocks; ++c) doorbell(job.windows[rank_], c).ring();
  // The comm blocks bound each of their waits; this bound only guards against a bug in them.
  std::unique_lock<std::mutex> lock(mutex_);
  const bool done = finished_.wait_for(lock, job.timeout * 4 + std::chrono::seconds(60), [&] { return running_ == 0; });
  job_ = nullptr;
  if (!done) {
    poisoned_ = "comm threads did not finish";
    TORCH_CHECK(false, current_op(), ": internal error: comm threads did not finish", where());
  }
}

int64_t FusedEngine::prepare_job(CallJob& job, const CallArgs& call, const LocalGemm& gemm, const RowChunks& chunks,
                                 const LayoutParams& need, const std::function<int64_t(CallJob&)>& choose_flow) {
  job.op = call.op == kOpGemmAllreduceAddRmsnorm ? kOpGemmAllreduce : call.op;
  job.epoch = epoch_;
  job.bank = call_bank(epoch_);
  TORCH_CHECK(make_row_chunked_plan(&job.plan, &job.chunks, chunks.count, chunks.rows, call.n, call.k, config_.base_m,
                                    config_.base_n, 1, 1, config_.sub_m),
              call.op_name, ": invalid tile plan for M=", call.m, " N=", call.n, " K=", call.k);
  // gemm_reduce_scatter: every row chunk's tiles go to the chunk's rank.
  job.own_run = job.op == kOpGemmReduceScatter ? chunk_ownership_run(job.plan, job.chunks) : 1;
  job.rank = rank_;
  job.world = world_;
  job.compute_blocks = config_.compute_blocks;
  job.comm_blocks = config_.comm_blocks;
  job.partial_dtype = gemm.compute_dtype();
  job.out_dtype = call.dtype;
  job.partial_elem = c10::elementSize(job.partial_dtype);
  job.out_elem = c10::elementSize(job.out_dtype);
  const LayoutParams needed = need.world != 0 ? need
                                              : make_layout_params(job.plan, job.out_elem, job.partial_elem, world_,
                                                                   job.compute_blocks, job.comm_blocks);
  TORCH_CHECK(layout_params_valid(needed), call.op_name, ": internal error: invalid window layout parameters");
  const int64_t slot_need = choose_flow ? choose_flow(job) : 0;
  if (!fits(needed, capacity_) || slot_need > slot_bytes_) {
    // Growing is collective, so agree on the call first (the comm blocks would check it only later): a rank
    // whose arguments differ must not be waited for in a growth it will never join. Every rank reaches the same
    // verdict from the same headers.
    check_every_signature(call);
    try {
      grow(needed, slot_need);
    } catch (...) {
      publish_abort(windows_->base(rank_), epoch_);
      ring_peers();
      throw;
    }
  }
  job.layout = regions_;
  job.windows = bases();
  job.output_slots_offset = slots_offset_of(regions_);
  job.output_slot_bytes = slot_bytes_;
  job.output_slots = slot_count_;
  job.gemm = &gemm;
  job.window_set = windows_.get();
  job.call = &call;
  job.signature = signature_;
  job.group_name = group_name_;
  job.timeout = wait_timeout();
  job.overlap = option(engine_options().overlap);
  job.ignore_epochs = test_hooks::ignore_epochs();
  // A rank may leave a call before its peers have read all of its data: a one-shot call ends once this rank has its
  // peers' partials, and a call that raises on its own arguments leaves once its header is out. So before this call
  // writes into the window (shard, partials, flags, bank), every peer must have started the previous call, so finished
  // the one before it. A peer still in the previous call reads nothing this call changes: after a one-shot call only
  // the other bank and flags it accepts one call ahead; other calls end once their data is read. After a call that
  // waited for its peers' data this holds at once.
  try {
    wait_for_previous_call(job);
  } catch (const std::exception& e) {
    publish_abort(windows_->base(rank_), epoch_);
    ring_peers();
    raise(e.what(), false);
  }
  return slot_need;
}

void FusedEngine::wait_for_previous_call(const CallJob& job) {
  if (test_hooks::skip_previous_call_wait()) return;
  wait_for_peers_to_start(job.windows, job.epoch);
}

void FusedEngine::wait_for_peers_to_start(const std::vector<uint8_t*>& windows, uint32_t epoch) {
  // A peer that has published its header of call e - 1 (or of e, in windows grown for this call: nobody reads old
  // data there) has finished call e - 2.
  auto started = [&](int r) { return started_call(windows[r], epoch - 1u) || started_call(windows[r], epoch); };
  bounded_wait(
      [&] {
        for (int r = 0; r < world_; ++r)
          if (r != rank_ && !started(r)) return false;
        return true;
      },
      no_progress, [&] { windows_->check_peers_alive(("before call " + std::to_string(epoch_)).c_str()); },
      [&] {
        return late_ranks(world_, rank_, [&](int r) { return !started(r); }) + " did not start call " +
               std::to_string(epoch_ - 1u) + " (so may still read this rank's data of an earlier call)" + where();
      },
      doorbell(windows_->base(rank_), kMainDoorbell), wait_timeout(), nullptr);
}

void FusedEngine::execute(CallJob& job) {
  for (int64_t b = 0; b < job.compute_blocks; ++b) {
    store_release(reinterpret_cast<uint32_t*>(job.region(rank_, queue_count_offset(job.layout, b))), 0);
  }
  if (config_.comm_inline) {
    try {
      run_call_inline(job);
    } catch (const std::exception& e) {
      job.fail((current_op() + ": the local GEMM failed: ") + e.what() + where(), false);
    }
  } else {
    run_with_comm_threads(job);
  }
  if (!job.error.empty()) {
    if (!job.error_is_disagreement) poisoned_ = job.error;
    raise(job.error, job.error_is_disagreement);
  }
}

at::Tensor FusedEngine::run(const CallArgs& call, const RowEpilogue& row_epilogue, const at::Tensor& add_into) {
  const bool scatter = call.op == kOpGemmReduceScatter;
  TORCH_CHECK(!add_into.defined() || (!scatter && add_into.is_contiguous() && add_into.numel() == call.m * call.n &&
                                      add_into.scalar_type() == call.dtype),
              call.op_name, ": internal error: bad in-place output");
  if (call.fused_family != config_family_) {
    // A tuning run of a forced tile family (the agreement had `auto`): every rank's tuner picked the same candidate
    // from the same agreed times, and call_config's inputs were agreed on (engine_mode_bits).
    config_family_ = call.fused_family;
    config_ = config_of(call, world_, config_family_);
  }
  // Rank 0 adds the bias to its partial product, so the reduced sum holds it once. Decode calls multiply in the
  // call's dtype, as `a @ b` does (their 2-byte partials reduce in one shot: cpu/call_plan.h).
  LocalGemm gemm(call.a2d, call.b, call.bias, /*add_bias=*/rank_ == 0, /*native=*/config_.decode);
  CallJob job;
  // The data flow (cpu/call_plan.h): the same on every rank, except where this rank's output goes (a free slot or
  // not), which only this rank's peers need to know.
  auto choose_flow = [&](CallJob& j) -> int64_t {
    const CallPlan flow =
        plan_call(plan_inputs(j.op, call.m, call.k, call.n, world_, j.chunks.count, j.partial_dtype, call.dtype, j.plan,
                              config_, static_cast<bool>(row_epilogue), add_into.defined()));
    j.owner_reduces_in_compute = flow.owner_reduces_in_compute();
    j.gathered_inputs = flow.flow == DataFlow::kGatheredInputs;
    j.one_shot = flow.flow == DataFlow::kOneShot;
    j.decode = flow.decode;
    j.one_product = flow.one_product;
    return flow.slot_output_bytes;
  };
  const bool wants_slot =
      prepare_job(job, call, gemm, scatter ? sequence_chunks(call, world_, false) : RowChunks{1, call.m, 0}, {},
                  choose_flow) > 0;
  std::vector<int64_t> out_shape = call.out_shape;
  if (scatter) out_shape[call.shard_dim] /= world_;
  at::Tensor out;
  int slot = -1;
  if (wants_slot && slots_) std::tie(out, slot) = slots_->take(call.m, call.n, call.dtype);
  if (!out.defined()) {
    out = add_into.defined() ? add_into : pooled_empty(scatter ? call.m / world_ : call.m, call.n, call.dtype);
  }
  job.out_in_slot = slot >= 0;
  // Every gemm_allreduce call says where its rows are (peers may read the word of this parity from an older call).
  if (!scatter) publish_output_slot(windows_->base(rank_), job.bank, job.out_in_slot ? slot + 1 : kRowsInBank);
  job.out = static_cast<uint8_t*>(out.data_ptr());
  job.out_holds_addend = add_into.defined() && !test_hooks::overwrite_residual();
  job.row_epilogue = row_epilogue;
  if (job.gathered_inputs) count_gathered_inputs_call();
  std::optional<PackedBPanels> panels;  // outlives the call's products
  if (!job.one_product && !job.gathered_inputs) use_packed_panels(gemm, job.plan, job.compute_blocks, panels);
  plan_work(job);
  execute(job);
  if (!scatter) {
    // This rank has copied every peer's rows: their owners may return (and their callers change their outputs).
    // Only an owner whose rows were in a slot waits for it (its slot word, published before the final flags this
    // rank acquired in the call, says so): wake just those.
    publish_copies_done(windows_->base(rank_), epoch_);
    for (int r = 0; r < world_; ++r) {
      if (r != rank_ && read_output_slot(windows_->base(r), job.bank) != kRowsInBank) {
        doorbell(windows_->base(r), kMainDoorbell).ring();
      }
    }
    if (job.out_in_slot) {
      try {
        wait_for_peer_copies(job);
      } catch (const std::exception& e) {
        publish_abort(windows_->base(rank_), epoch_);
        ring_peers();
        poisoned_ = e.what();
        raise(std::string(e.what()) + where(), false);
      }
    }
  }
  return out.view(out_shape);
}

std::tuple<at::Tensor, at::Tensor> FusedEngine::run_allgather(const CallArgs& call) {
  const RowChunks chunks = sequence_chunks(call, world_, true);
  std::vector<int64_t> gathered_shape = call.out_shape;  // a's shape, its shard dim `world` times as large
  gathered_shape.back() = call.k;
  gathered_shape[call.shard_dim] *= world_;
  const int64_t m = chunks.count * chunks.rows;
  auto gathered = at::empty({m, call.k}, call.a2d.options().memory_format(at::MemoryFormat::Contiguous));
  LocalGemm gemm(gathered, call.b, call.bias, /*add_bias=*/true);
  CallJob job;
  // The window holds this rank's shard where the partial products would be, one flag per tile row, and one final
  // flag (copies done): allgather_layout_params (layout.hpp).
  TilePlan plan{};
  RowChunks c{};
  TORCH_CHECK(make_row_chunked_plan(&plan, &c, chunks.count, chunks.rows, call.n, call.k, config_.base_m,
                                    config_.base_n, 1, 1, config_.sub_m),
              call.op_name, ": invalid tile plan for M=", m, " N=", call.n, " K=", call.k);
  const auto a_elem = static_cast<int64_t>(c10::elementSize(call.dtype));
  const LayoutParams need = allgather_layout_params(call.m, call.k, a_elem, world_, plan.tiles, plan.m_tiles,
                                                    config_.compute_blocks, config_.comm_blocks);
  prepare_job(job, call, gemm, chunks, need);
  auto out = pooled_empty(m, call.n, call.dtype);
  job.out = static_cast<uint8_t*>(out.data_ptr());
  job.gathered = static_cast<uint8_t*>(gathered.data_ptr());
  job.a_elem = c10::elementSize(call.dtype);
  // B's panels packed once for all tile rows, not once per tile (packed_b_panels.h).
  std::optional<PackedBPanels> panels;  // outlives the call's products
  use_packed_panels(gemm, job.plan, job.compute_blocks, panels);
  job.one_product = plan_call(plan_inputs(job.op, m, call.k, call.n, world_, job.chunks.count, job.partial_dtype,
                                          call.dtype, job.plan, config_, false, false))
                        .one_product;
  plan_work(job);  // sizes rows_arrived, which publish_shard sets for the local rows
  publish_shard(job, call.a2d);
  execute(job);
  std::vector<int64_t> out_shape = gathered_shape;
  out_shape.back() = call.n;
  return {out.view(out_shape), gathered.view(gathered_shape)};
}

}  // namespace gemm_ar::cpu
