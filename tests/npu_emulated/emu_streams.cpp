#include "emu_streams.h"

#include <c10/util/Exception.h>

#include "emu_graph.h"
#include "emu_settings.h"

#include <atomic>
#include <cstdlib>

namespace gemm_ar::emu {

std::chrono::milliseconds wait_bound() {
  static const std::chrono::milliseconds bound(settings::wait_seconds() * 1000);
  return bound;
}

void Event::complete() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    done = true;
    when = std::chrono::steady_clock::now();
  }
  done_cv.notify_all();
}

bool Event::query() {
  std::lock_guard<std::mutex> lock(mutex);
  return done;
}

bool Event::wait_for(std::chrono::milliseconds bound) {
  std::unique_lock<std::mutex> lock(mutex);
  return done_cv.wait_for(lock, bound, [this] { return done; });
}

Worker::Worker(int64_t id) : id_(id), thread_([this] { run(); }) {
  // Never joined: streams live as long as the process (their threads idle on ready_ at exit).
  thread_.detach();
}

void Worker::enqueue(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (capture_) {
      capture_->add(GraphNode{GraphNode::Kind::kTask, id_, std::move(task), -1});
      return;
    }
    tasks_.push_back(std::move(task));
  }
  ready_.notify_one();
}

void Worker::enqueue_launch(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (capture_) {
      capture_->add(GraphNode{GraphNode::Kind::kLaunch, id_, std::move(task), -1});
      return;
    }
  }
  if (take_dropped_launch()) return;
  enqueue(std::move(task));
}

std::shared_ptr<Event> Worker::record() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (capture_) {
      auto event = std::make_shared<Event>();
      event->slot = capture_->add_record(id_);
      event->capture = capture_;
      return event;
    }
  }
  return marker();
}

std::shared_ptr<Event> Worker::marker() {
  auto event = std::make_shared<Event>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back([event] { event->complete(); });
  }
  ready_.notify_one();
  return event;
}

void Worker::wait_for(const std::shared_ptr<Event>& event) {
  if (event->slot >= 0) {
    std::shared_ptr<Capture> capture = event->capture.lock();
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(capture != nullptr && capture_underway(), "emulated NPU: stream ", id_,
                " waits for an event recorded in a capture that ended");
    TORCH_CHECK(!capture_ || capture_ == capture, "emulated NPU: stream ", id_, " waits for another capture's event");
    if (!capture_) {
      capture_ = capture;
      capture_->join(id_);
    }
    capture_->add(GraphNode{GraphNode::Kind::kWait, id_, nullptr, event->slot});
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // As on the device: a capture holds no dependency on work outside it.
    TORCH_CHECK(!capture_, "emulated NPU: stream ", id_,
                " is being captured and waits for an event recorded outside the capture");
  }
  const int64_t id = id_;
  enqueue([event, id] {
    TORCH_CHECK(event->wait_for(wait_bound()), "stream ", id, " waited for an event longer than ",
                wait_bound().count() / 1000, " s (GEMM_AR_EMU_WAIT_S)");
  });
}

bool Worker::capturing() {
  std::lock_guard<std::mutex> lock(mutex_);
  return capture_ != nullptr;
}

void Worker::set_capture(std::shared_ptr<Capture> capture) {
  std::lock_guard<std::mutex> lock(mutex_);
  capture_ = std::move(capture);
}

bool Worker::idle() {
  std::lock_guard<std::mutex> lock(mutex_);
  return tasks_.empty() && running_ == 0;
}

void Worker::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [this] { return !tasks_.empty(); });
      task = std::move(tasks_.front());
      tasks_.pop_front();
      running_ = 1;
    }
    try {
      task();
    } catch (const std::exception& e) {
      set_device_error("a task on emulated stream " + std::to_string(id_) + " failed: " + e.what());
    }
    // Destroyed outside the lock: a task's captured tensors may queue their release on this very stream.
    task = nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    running_ = 0;
  }
}

namespace {

struct Streams {
  std::mutex mutex;
  std::vector<Worker*> workers;  // never destroyed
};

Streams& streams() {
  static auto* all = [] {
    auto* s = new Streams();
    s->workers.push_back(new Worker(0));
    return s;
  }();
  return *all;
}

thread_local int64_t current_id = 0;

std::mutex& error_mutex() {
  static auto* mutex = new std::mutex();
  return *mutex;
}
std::string& device_error() {
  static auto* error = new std::string();
  return *error;
}

}  // namespace

Worker& stream(int64_t id) {
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(s.workers.size()), "no emulated NPU stream with id ", id);
  return *s.workers[static_cast<size_t>(id)];
}

Worker& new_stream() {
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.workers.push_back(new Worker(static_cast<int64_t>(s.workers.size())));
  return *s.workers.back();
}

std::vector<Worker*> all_streams() {
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.workers;
}

int64_t current_stream_id() { return current_id; }
void set_current_stream_id(int64_t id) {
  stream(id);  // checks it exists
  current_id = id;
}

void set_device_error(const std::string& message) {
  std::lock_guard<std::mutex> lock(error_mutex());
  if (device_error().empty()) device_error() = message;
}

void report_device_error() {
  std::string message;
  {
    std::lock_guard<std::mutex> lock(error_mutex());
    message.swap(device_error());
  }
  TORCH_CHECK(message.empty(), "emulated NPU: ", message);
}

namespace {
// Relaxed: a count the tests read between calls of the same thread, ordering nothing.
std::atomic<uint64_t> synchronisations{0};
}  // namespace

// Relaxed as well: set by the test between calls, read by the same thread's next launches.
std::atomic<int64_t> launches_to_drop{0};
std::atomic<int64_t> mesh_contexts{0}, ring_contexts{0};

void drop_next_launches(int64_t count) { launches_to_drop.store(count, std::memory_order_relaxed); }
bool take_dropped_launch() {
  int64_t left = launches_to_drop.load(std::memory_order_relaxed);
  while (left > 0) {
    if (launches_to_drop.compare_exchange_weak(left, left - 1, std::memory_order_relaxed)) return true;
  }
  return false;
}

namespace {
// Relaxed: set by the test while no replay runs, read by the replayed tasks after the host queued them.
std::atomic<bool> skip_counter_in_replays{false};
}  // namespace

void set_replays_skip_counter(bool skip) { skip_counter_in_replays.store(skip, std::memory_order_relaxed); }
bool replays_skip_counter() { return skip_counter_in_replays.load(std::memory_order_relaxed); }

namespace {
// Relaxed: a count the tests read after synchronising every stream.
std::atomic<uint64_t> overlaps{0};
}  // namespace

void count_overlapping_kernel() { overlaps.fetch_add(1, std::memory_order_relaxed); }
uint64_t overlapping_kernels() { return overlaps.load(std::memory_order_relaxed); }

void count_context(bool mesh) { (mesh ? mesh_contexts : ring_contexts).fetch_add(1, std::memory_order_relaxed); }
int64_t contexts_built(bool mesh) { return (mesh ? mesh_contexts : ring_contexts).load(std::memory_order_relaxed); }

void count_host_synchronisation() { synchronisations.fetch_add(1, std::memory_order_relaxed); }
uint64_t host_synchronisations() { return synchronisations.load(std::memory_order_relaxed); }

void synchronize(Worker& worker) {
  TORCH_CHECK(!worker.capturing(), "emulated NPU: stream ", worker.id(),
              " is being captured into a graph: it cannot be synchronised");
  const std::shared_ptr<Event> done = worker.marker();
  TORCH_CHECK(done->wait_for(wait_bound()), "emulated NPU: stream ", worker.id(), " did not drain within ",
              wait_bound().count() / 1000, " s (GEMM_AR_EMU_WAIT_S)");
  report_device_error();
}

void synchronize_all() {
  TORCH_CHECK(!capture_underway(),
              "emulated NPU: a stream is being captured into a graph: the device cannot be "
              "synchronised");
  for (Worker* worker : all_streams()) {
    const std::shared_ptr<Event> done = worker->marker();
    TORCH_CHECK(done->wait_for(wait_bound()), "emulated NPU: stream ", worker->id(), " did not drain within ",
                wait_bound().count() / 1000, " s (GEMM_AR_EMU_WAIT_S)");
  }
  report_device_error();
}

}  // namespace gemm_ar::emu
