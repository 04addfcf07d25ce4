// Graph capture and replay on the emulated Ascend runtime (docs/decisions/0019-emulated-npu-runtime.md), as the
// runtime's stream capture does it: between begin_capture and end_capture, what the host queues on the capturing
// stream (and on every stream that waited for an event recorded in the capture, which joins it) is recorded, not run;
// a replay queues the recorded work again, the same tasks with the same arguments, with fresh events. Memory freed
// while a capture is underway stays allocated as long as the graph lives (the device allocator's graph pool), since a
// replay reuses it.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

namespace gemm_ar::emu {

class Graph;

struct GraphNode {
  enum class Kind { kTask, kLaunch, kRecord, kWait };
  Kind kind = Kind::kTask;
  int64_t stream = 0;
  std::function<void()> task;  // kTask, kLaunch
  int64_t slot = -1;           // kRecord, kWait: which of the capture's events
};

// A capture underway: the nodes its streams queued, in queuing order. Guarded by its own mutex.
class Capture {
 public:
  explicit Capture(int64_t origin) : origin_(origin) {}
  int64_t origin() const { return origin_; }
  void add(GraphNode node);
  // A new event slot, recorded on `stream` at this point.
  int64_t add_record(int64_t stream);
  void join(int64_t stream);
  // Memory freed during the capture: `release` runs when the graph (or the failed capture) goes.
  void hold(std::function<void()> release);

 private:
  friend std::shared_ptr<Graph> end_capture(int64_t stream);
  std::mutex mutex_;
  const int64_t origin_;
  std::vector<GraphNode> nodes_;
  int64_t slots_ = 0;
  std::set<int64_t> streams_;  // the joined ones, origin included
  std::vector<std::function<void()>> held_;
};

class Graph {
 public:
  Graph(int64_t origin, std::vector<GraphNode> nodes, int64_t slots, std::vector<std::function<void()>> held)
      : origin_(origin), nodes_(std::move(nodes)), slots_(slots), held_(std::move(held)) {}
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph();
  // Queues the recorded work again: the capturing stream's on `stream`, every joined stream's on that stream.
  void replay(int64_t stream) const;
  size_t launches() const;

 private:
  const int64_t origin_;
  const std::vector<GraphNode> nodes_;
  const int64_t slots_;
  std::vector<std::function<void()>> held_;
};

// Starts capturing `stream` (one capture at a time in this emulation).
void begin_capture(int64_t stream);
// Ends the capture begun on `stream`; throws when a stream that joined it was not joined back to it.
std::shared_ptr<Graph> end_capture(int64_t stream);
bool capture_underway();
// Hands `release` to the capture underway (true), or returns false when there is none.
bool hold_while_capturing(const std::function<void()>& release);

}  // namespace gemm_ar::emu
