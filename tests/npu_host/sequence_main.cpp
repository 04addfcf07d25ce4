// Runs the NPU host's call sequence (csrc/host/npu/fused_call_sequence.h) and its error bookkeeping
// (csrc/host/common/kernel_error_watch.cpp) against an emulated device, several ranks in one process
// (tests/test_npu_call_sequence.py). No torch, no NPU: only the runtime is emulated, the host logic is the product's.
//
// The emulation: every stream is a worker thread running its tasks in order; an event completes when its record
// task ran; a stream that waits for an event blocks only itself. Each rank has a device epoch counter, an error
// record and a pinned host copy of it. Its kernels are fakes that keep the real kernels' contract: both read the
// epoch counter when they start, and the comm kernel meets the other ranks' comm kernels of the same epoch (a
// bounded wait; on timeout it writes the error record, as the real kernels do).
//
// Usage: sequence_main <scenario> <world> <calls> <seed>
//   side_stream   one host thread per rank queues calls alternately on two streams of its own
//   two_threads   two host threads per rank, each with its own stream, take turns in call order
//   failure       one host thread per rank; rank 1's kernel of call 2 records a failure (its peers succeed)
//   straggler     one host thread per rank; rank 1's host pauses longer than the kernels' bound before call 2, so
//                 its peers time out; after call 4 every rank synchronises its streams and meets the others (what
//                 an HCCL collective with a wait does), and the calls after it must work again
// Output: one line per call and rank, "call <rank> <index> <compute epoch> <comm epoch> <status>", then
// "raised <rank> <index> <message>" per error the host raised, then "overlaps <n>" (kernels of two calls of one
// rank's group on the device at once) and "reused_epochs <n>" (one rank's comm kernels meeting with one epoch
// twice).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/kernel_error_watch.h"
#include "npu/fused_call_sequence.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kKernelWait = std::chrono::milliseconds(1500);  // the fake kernels' bound (TORCH_GEMM_AR_TIMEOUT_S)
constexpr auto kStreamWaitLimit = std::chrono::seconds(60);    // a wait the emulation itself never needs this long

class EmuEvent {
 public:
  void set() {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    cv_.notify_all();
  }
  bool query() {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }
  bool wait_for(Clock::duration limit) {
    std::unique_lock<std::mutex> lock(mutex_);
    return cv_.wait_for(lock, limit, [this] { return done_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
};

// A stream: a worker thread running its tasks in the order they were queued.
class EmuStream {
 public:
  EmuStream() : worker_([this] { run(); }) {}
  ~EmuStream() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  void push(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_all();
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;  // stopping, and everything queued ran
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::thread worker_;  // last: starts after the members it uses
};

using Stream = std::shared_ptr<EmuStream>;
using Event = std::shared_ptr<EmuEvent>;

// What the comm kernels of all ranks share: who arrived at which epoch (the window's signature slots).
struct Window {
  std::mutex mutex;
  std::condition_variable cv;
  std::map<uint32_t, std::set<int>> arrived;
  std::atomic<int> reused_epochs{0};
};

struct CallResult {
  int64_t compute_epoch = -1, comm_epoch = -1;
  std::string status = "not_run";
};

// One rank's device and host state for one group.
struct Rank {
  int rank = 0;
  std::atomic<int64_t> epoch_counter{0};
  std::mutex record_mutex;  // the device record and the host copy (the emulated copy engine takes it)
  gemm_ar::ErrorRecord record{};
  gemm_ar::ErrorRecord host_copy{};
  Event copy_landed;
  gemm_ar::KernelErrorWatch watch;
  gemm_ar::npu::GroupOrder<Event> order;
  std::mutex group_mutex;  // CommState::mutex
  Stream comm_stream;      // the group's own comm stream (CommState::comm_stream)
  std::mutex live_mutex;
  std::map<int, int> live;  // call index -> its kernels running on the device now
  std::mutex results_mutex;
  std::map<int, CallResult> results;
  std::vector<std::string> raised;
};

class EmuRuntime {
 public:
  using Stream = ::Stream;
  using Event = ::Event;

  explicit EmuRuntime(Rank& r) : r_(r) {}

  Event record(const Stream& stream) {
    auto event = std::make_shared<EmuEvent>();
    stream->push([event] { event->set(); });
    return event;
  }
  void stream_waits_for(const Stream& stream, const Event& event) {
    stream->push([event] {
      if (!event->wait_for(kStreamWaitLimit)) {
        std::fprintf(stderr, "emulated stream waited 60 s for an event\n");
        std::abort();
      }
    });
  }
  void add_epoch(const Stream& stream) {
    Rank* r = &r_;
    stream->push([r] { r->epoch_counter.fetch_add(1, std::memory_order_seq_cst); });
  }
  bool capturing(const Stream&) { return false; }
  void refresh_error_copy(const Stream& stream) {
    auto landed = std::make_shared<EmuEvent>();
    Rank* r = &r_;
    stream->push([r, landed] {
      {
        std::lock_guard<std::mutex> lock(r->record_mutex);
        r->host_copy = r->record;
      }
      landed->set();
    });
    r_.copy_landed = landed;
  }
  std::string take_landed_failure() {
    if (!r_.copy_landed || !r_.copy_landed->query()) return "";
    gemm_ar::ErrorRecord copy;
    {
      std::lock_guard<std::mutex> lock(r_.record_mutex);
      copy = r_.host_copy;
    }
    return r_.watch.take_unreported(copy, "tp", nullptr, nullptr);
  }

 private:
  Rank& r_;
};

struct Job {
  std::mutex barrier_mutex;
  std::condition_variable barrier_cv;
  int barrier_arrived = 0;
  std::string scenario;
  int world = 2;
  int calls = 8;
  Window window;
  std::vector<std::unique_ptr<Rank>> ranks;
  std::atomic<int> overlaps{0};
};

void write_record(Rank& r, uint32_t epoch, int32_t code, int32_t peer) {
  std::lock_guard<std::mutex> lock(r.record_mutex);
  r.record.code = code;
  r.record.rank = r.rank;
  r.record.peer = peer;
  r.record.item = -1;
  r.record.tag = gemm_ar::signal_tag(epoch);
}

// A kernel of call `index` starts: any other call's kernel still running on this rank is an overlap.
void kernel_starts(Job& job, Rank& r, int index) {
  std::lock_guard<std::mutex> lock(r.live_mutex);
  for (const auto& entry : r.live) {
    if (entry.first != index) job.overlaps.fetch_add(1);
  }
  ++r.live[index];
}

void kernel_ends(Rank& r, int index) {
  std::lock_guard<std::mutex> lock(r.live_mutex);
  if (--r.live[index] == 0) r.live.erase(index);
}

void compute_kernel(Job& job, Rank& r, int index, int sleep_us) {
  kernel_starts(job, r, index);
  const int64_t epoch = r.epoch_counter.load(std::memory_order_seq_cst);
  std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
  kernel_ends(r, index);
  std::lock_guard<std::mutex> lock(r.results_mutex);
  r.results[index].compute_epoch = epoch;
}

void comm_kernel(Job& job, Rank& r, int index, bool inject_failure) {
  kernel_starts(job, r, index);
  const uint32_t epoch = static_cast<uint32_t>(r.epoch_counter.load(std::memory_order_seq_cst));
  std::string status = "ok";
  {
    std::unique_lock<std::mutex> lock(job.window.mutex);
    if (!job.window.arrived[epoch].insert(r.rank).second) job.window.reused_epochs.fetch_add(1);
    job.window.cv.notify_all();
    const bool met = job.window.cv.wait_for(lock, kKernelWait, [&] {
      return static_cast<int>(job.window.arrived[epoch].size()) >= job.world;
    });
    if (!met) {
      int missing = 0;
      while (job.window.arrived[epoch].count(missing) != 0) ++missing;
      lock.unlock();
      write_record(r, epoch, gemm_ar::kErrTimeoutPrepare, missing);
      status = "timeout";
    }
  }
  if (status == "ok" && inject_failure) {
    write_record(r, epoch, gemm_ar::kErrTimeoutReduce, (r.rank + 1) % job.world);
    status = "failed";
  }
  kernel_ends(r, index);
  std::lock_guard<std::mutex> lock(r.results_mutex);
  r.results[index].comm_epoch = epoch;
  r.results[index].status = status;
}

// What launch_fused does around the kernels: the group's mutex, queue_fused_call, then raise an earlier failure.
void host_call(Job& job, Rank& r, int index, const Stream& caller, int compute_us) {
  std::lock_guard<std::mutex> lock(r.group_mutex);
  r.watch.take_epoch();
  const Stream comm = r.comm_stream;
  const bool inject = job.scenario == "failure" && r.rank == 1 && index == 2;
  EmuRuntime runtime(r);
  Job* j = &job;
  Rank* rp = &r;
  const std::string earlier =
      gemm_ar::npu::queue_fused_call(runtime, r.order, caller, comm, [&](const Stream& c, const Stream& m) {
        c->push([j, rp, index, compute_us] { compute_kernel(*j, *rp, index, compute_us); });
        m->push([j, rp, index, inject] { comm_kernel(*j, *rp, index, inject); });
      });
  if (!earlier.empty()) {
    std::lock_guard<std::mutex> results_lock(r.results_mutex);
    r.raised.push_back(std::to_string(index) + " " + earlier);
  }
}

// Waits for everything queued on the streams, then for every rank to get here.
void synchronise_and_meet(Job& job, Rank& r, const std::vector<Stream>& own) {
  std::vector<Stream> all = own;
  all.push_back(r.comm_stream);
  EmuRuntime runtime(r);
  for (const Stream& stream : all) runtime.record(stream)->wait_for(kStreamWaitLimit);
  std::unique_lock<std::mutex> lock(job.barrier_mutex);
  ++job.barrier_arrived;
  job.barrier_cv.notify_all();
  job.barrier_cv.wait(lock, [&] { return job.barrier_arrived >= job.world; });
}

void run_rank(Job& job, Rank& r, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> compute_us(200, 3000);
  std::uniform_int_distribution<int> host_gap_us(0, 2000);
  std::vector<Stream> own{std::make_shared<EmuStream>(), std::make_shared<EmuStream>()};
  if (job.scenario == "two_threads") {
    std::mutex turn_mutex;
    std::condition_variable turn_cv;
    int turn = 0;
    std::vector<int> durations(static_cast<size_t>(job.calls));
    for (int& d : durations) d = compute_us(rng);
    auto thread_body = [&](int t) {
      for (int i = t; i < job.calls; i += 2) {
        std::unique_lock<std::mutex> lock(turn_mutex);
        turn_cv.wait(lock, [&] { return turn == i; });
        lock.unlock();
        host_call(job, r, i, own[static_cast<size_t>(t)], durations[static_cast<size_t>(i)]);
        lock.lock();
        ++turn;
        turn_cv.notify_all();
      }
    };
    std::thread a(thread_body, 0), b(thread_body, 1);
    a.join();
    b.join();
  } else {
    for (int i = 0; i < job.calls; ++i) {
      if (job.scenario == "straggler" && r.rank == 1 && i == 2) std::this_thread::sleep_for(kKernelWait * 4 / 3);
      host_call(job, r, i, own[static_cast<size_t>(i % 2)], compute_us(rng));
      if (job.scenario == "straggler" && i == 4) synchronise_and_meet(job, r, own);
      // The failure scenario leaves time for copies to land, as a real model's other work does.
      const int gap = job.scenario == "failure" || job.scenario == "straggler" ? 30000 : host_gap_us(rng);
      std::this_thread::sleep_for(std::chrono::microseconds(gap));
    }
  }
  own.clear();  // drains this rank's streams
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s side_stream|two_threads|failure|straggler <world> <calls> <seed>\n", argv[0]);
    return 2;
  }
  Job job;
  job.scenario = argv[1];
  job.world = std::atoi(argv[2]);
  job.calls = std::atoi(argv[3]);
  const uint32_t seed = static_cast<uint32_t>(std::strtoul(argv[4], nullptr, 10));
  if (job.scenario != "side_stream" && job.scenario != "two_threads" && job.scenario != "failure" &&
      job.scenario != "straggler") {
    return 2;
  }
  const uint32_t first_epoch = seed * 2654435761u;  // agreed at setup in the product
  for (int r = 0; r < job.world; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->rank = r;
    rank->epoch_counter = first_epoch;
    rank->watch = gemm_ar::KernelErrorWatch(first_epoch);
    rank->comm_stream = std::make_shared<EmuStream>();
    job.ranks.push_back(std::move(rank));
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < job.world; ++r) {
    threads.emplace_back(run_rank, std::ref(job), std::ref(*job.ranks[static_cast<size_t>(r)]),
                         seed + static_cast<uint32_t>(r));
  }
  for (auto& t : threads) t.join();
  for (auto& rank : job.ranks) rank->comm_stream.reset();  // drains the comm stream
  for (auto& rank : job.ranks) {
    for (int i = 0; i < job.calls; ++i) {
      const CallResult& res = rank->results[i];
      const auto offset = [&](int64_t epoch) {
        return epoch < 0 ? int64_t{-1} : static_cast<int64_t>(static_cast<uint32_t>(epoch - first_epoch));
      };
      std::printf("call %d %d %lld %lld %s\n", rank->rank, i, static_cast<long long>(offset(res.compute_epoch)),
                  static_cast<long long>(offset(res.comm_epoch)), res.status.c_str());
    }
    for (const std::string& raised : rank->raised) std::printf("raised %d %s\n", rank->rank, raised.c_str());
  }
  std::printf("overlaps %d\n", job.overlaps.load());
  std::printf("reused_epochs %d\n", job.window.reused_epochs.load());
  return 0;
}
