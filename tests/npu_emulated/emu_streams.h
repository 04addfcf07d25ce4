// Streams and events of the emulated Ascend runtime (docs/decisions/0019-emulated-npu-runtime.md): every stream is a
// worker thread running a FIFO of tasks; an event completes when its stream's worker reaches it; a cross-stream wait
// blocks only the waiting stream's worker, for a bounded time. A task that fails (an exception, a wait that timed
// out) leaves a sticky device error, raised by the next synchronisation, as the runtime's sticky errors are. A stream
// being captured (emu_graph.h) records what is queued on it instead of running it.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace gemm_ar::emu {

// How long a stream or the host waits for an event before it gives up (GEMM_AR_EMU_WAIT_S, default 120 s): longer
// than the kernels' own bound, so that a kernel's timeout is what a test sees first.
std::chrono::milliseconds wait_bound();

class Capture;

struct Event {
  // An event recorded during a capture is a node of the graph (slot >= 0), never completed itself: only waits of
  // the same capture may name it.
  int64_t slot = -1;
  std::weak_ptr<Capture> capture;

  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;
  std::chrono::steady_clock::time_point when;  // when the stream reached it

  void complete();
  bool query();
  // False when the bound passed first.
  bool wait_for(std::chrono::milliseconds bound);
};

class Worker {
 public:
  explicit Worker(int64_t id);
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  int64_t id() const { return id_; }
  void enqueue(std::function<void()> task);
  // A kernel launch: dropped at queuing time when drop_next_launches says so (when captured: at each replay).
  void enqueue_launch(std::function<void()> task);
  // An event completed when every task queued so far has run (a node of the graph while capturing).
  std::shared_ptr<Event> record();
  // This stream runs nothing more until `event` completed (bounded). Waiting for an event of a capture joins it.
  void wait_for(const std::shared_ptr<Event>& event);
  // As record, never captured: for the runtime's own bookkeeping (synchronisation, the allocator).
  std::shared_ptr<Event> marker();
  bool capturing();
  void set_capture(std::shared_ptr<Capture> capture);
  // Whether every task queued so far has run.
  bool idle();

 private:
  void run();

  const int64_t id_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> tasks_;
  std::shared_ptr<Capture> capture_;  // while capturing
  size_t running_ = 0;                // 1 while a task runs
  std::thread thread_;
};

// Streams of the one emulated device: id 0 is the default stream; new ones are never destroyed (their ids are
// c10::Stream ids and NativeStream handles).
Worker& stream(int64_t id);
Worker& new_stream();
std::vector<Worker*> all_streams();

// The current stream of the calling thread (as torch_npu's, per thread).
int64_t current_stream_id();
void set_current_stream_id(int64_t id);

// The first failure of a task since the last report; report_device_error throws it (and clears it).
void set_device_error(const std::string& message);
void report_device_error();

// Host synchronisations the host code asked for (DeviceControl's waits and blocking copies, the process group's
// collectives), counted so that the tests can check that a call asked for none.
void count_host_synchronisation();
uint64_t host_synchronisations();

// Negative control (tests only): the next `count` kernel launches of this process are dropped, as kernels the
// runtime never ran or killed at once.
void drop_next_launches(int64_t count);
bool take_dropped_launch();
// Negative control (tests only): the epoch counter increments recorded in a graph do nothing when replayed, so
// every replay's kernels see the epoch of the capture.
void set_replays_skip_counter(bool skip);
bool replays_skip_counter();

// Kernels that started while a kernel of another call of the same communicator ran (emu_runtime.cpp): a group's
// calls must not overlap on the device, while one call's compute and comm kernels do.
void count_overlapping_kernel();
uint64_t overlapping_kernels();

// Which contexts the emulated HCCL built in this process (MESH, RING).
void count_context(bool mesh);
int64_t contexts_built(bool mesh);

// Waits for every task queued so far on `worker` / on every stream (bounded), then reports a device error.
void synchronize(Worker& worker);
void synchronize_all();

}  // namespace gemm_ar::emu
