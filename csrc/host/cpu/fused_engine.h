// The CPU fused engine of one process group: its shared windows, its comm threads and its call counter.
// Created collectively on the group's first call on CPU; released (comm threads joined, windows unmapped) once the
// group is destroyed or garbage-collected, at the next call of the op in this process.
#pragma once
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <condition_variable>
#include <gemm_ar/tile_plan.hpp>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "common/call_args.h"
#include "common/rank_agreement.h"
#include "cpu/call_geometry.h"
#include "cpu/engine_config.h"
#include "cpu/fused_call.h"
#include "cpu/packed_b_panels.h"
#include "cpu/shared_outputs.h"
#include "cpu/window_set.h"

namespace gemm_ar::cpu {

class FusedEngine {
 public:
  // The engine of `group`; the first call for a group is collective (all its ranks make it, as they do for the
  // op's first call on that group).
  // Only that group's own setup waits for peers: no process-wide lock is held meanwhile. Raises in a forked child
  // for groups whose engine its parent set up.
  static std::shared_ptr<FusedEngine> of(c10d::ProcessGroup& group);
  ~FusedEngine();
  FusedEngine(const FusedEngine&) = delete;
  FusedEngine& operator=(const FusedEngine&) = delete;

  // Held by the op across a whole call on this group (agreement and run): calls on one group from several threads
  // run one after another, each paired across ranks by order of arrival and checked by the call agreement.
  std::mutex& call_mutex() { return call_mutex_; }

  // "" when the fused path can run on this group; otherwise why not (ranks on several hosts, an earlier failure).
  std::string unavailable_reason() const;
  // Whether calls on this group agree through the window headers (otherwise through the process group).
  // (Also after a failure: every rank must keep agreeing through the same channel.)
  bool has_windows() const { return windows_ != nullptr; }

  // Starts the next call on this rank: publishes its signature; raises this rank's own argument error (peers read
  // it from the header). Unless a fused run follows (which checks the headers in its comm thread while the GEMM
  // already runs), waits for every rank's signature and raises the same diagnosis on every rank.
  std::vector<CallSignature> agree(const CallArgs& call, Algorithm chosen);
  // `row_epilogue` (may be empty): run on every finished row block of the output during the copy-out.
  // gemm_allreduce, or gemm_reduce_scatter (call.op): then this rank's chunk of the reduced product.
  // `add_into` (gemm_allreduce only; contiguous [M, N] of the call's dtype): the output is added into this tensor
  // in place (the in-place add+RMSNorm's residual) and it is returned, instead of a new output.
  at::Tensor run(const CallArgs& call, const RowEpilogue& row_epilogue = {}, const at::Tensor& add_into = {});
  // allgather_gemm: (all_gather(a) @ b (+ bias), the gathered a).
  std::tuple<at::Tensor, at::Tensor> run_allgather(const CallArgs& call);

 private:
  FusedEngine(c10d::ProcessGroup& group);
  // Grows the windows (collectively) so that the fixed region layout holds `need`.
  // `slot_bytes`: the output slots' size wanted (cpu/shared_outputs.h); 0 keeps the current one.
  void grow(const LayoutParams& need, int64_t slot_bytes);
  // Waits for every rank's header of the current call and raises the diagnosis, if any, on every rank.
  std::vector<CallSignature> check_every_signature(const CallArgs& call);
  // Fills the job's plan (row chunks `chunks`), blocks and windows for this call, growing the windows to hold
  // `need` (need.world == 0: the layout of the plan's partial products, reduced banks and queues).
  // `choose_flow` (may be empty) runs once the plan is made: it sets the job's data flow and returns the output slot
  // size the call wants (0: none), so that the windows grow for both at once. Returns that size.
  int64_t prepare_job(CallJob& job, const CallArgs& call, const LocalGemm& gemm, const RowChunks& chunks,
                      const LayoutParams& need, const std::function<int64_t(CallJob&)>& choose_flow = {});
  // Runs a planned job (compute blocks here, comm blocks on the comm threads or between tiles); raises its error.
  // Waits until every peer has started the call before this one (see execute).
  void wait_for_previous_call(const CallJob& job);
  // Until every peer has started call `epoch` - 1 or `epoch` (bounded; names a late or dead peer).
  void wait_for_peers_to_start(const std::vector<uint8_t*>& windows, uint32_t epoch);
  void execute(CallJob& job);
  void start_comm_threads(int64_t count);
  void run_with_comm_threads(CallJob& job);
  void comm_thread_main(int64_t c);
  std::vector<uint8_t*> bases() const;
  void ring_peers() const;
  std::string where() const;

  std::mutex call_mutex_;
  std::string group_name_;
  int rank_, world_;
  std::unique_ptr<WindowSet> windows_;
  std::string unavailable_, poisoned_;
  uint32_t epoch_ = 0;
  EngineConfig config_{};
  int64_t config_family_ = 0;  // the tile family config_ was made for (CallArgs::fused_family)
  // Region offsets stay fixed between growths, sized for the largest call so far: a call never writes where the
  // previous call's data (still read by a slower peer) lay under another shape's layout.
  LayoutParams capacity_{};
  WindowLayout regions_{};
  // The output slots at the end of the windows (cpu/shared_outputs.h): their size (0: none) and this rank's ones.
  int64_t slot_bytes_ = 0;
  int slot_count_ = 0;
  std::unique_ptr<SharedOutputSlots> slots_;
  CallSignature signature_{};

  std::mutex mutex_;
  std::condition_variable wake_, finished_;
  std::vector<std::thread> threads_;
  CallJob* job_ = nullptr;
  uint64_t job_generation_ = 0;
  int64_t running_ = 0;         // comm blocks of the current call still working
  int64_t running_blocks_ = 0;  // comm blocks of the current call
  bool stopping_ = false;       // set by the destructor: comm threads return
};

}  // namespace gemm_ar::cpu
