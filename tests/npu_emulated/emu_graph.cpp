#include "emu_graph.h"

#include <c10/util/Exception.h>

#include <string>
#include <utility>

#include "emu_streams.h"

namespace gemm_ar::emu {
namespace {

std::mutex& active_mutex() {
  static auto* mutex = new std::mutex();
  return *mutex;
}
std::shared_ptr<Capture>& active() {
  static auto* capture = new std::shared_ptr<Capture>();
  return *capture;
}

// Whether a stream other than the origin ended its part of the capture with an event the origin waited for later.
bool joined_back(const std::vector<GraphNode>& nodes, int64_t origin, int64_t stream) {
  size_t last = nodes.size();
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i].stream == stream) last = i;
  }
  if (last == nodes.size() || nodes[last].kind != GraphNode::Kind::kRecord) return false;
  for (size_t i = last + 1; i < nodes.size(); ++i) {
    if (nodes[i].stream == origin && nodes[i].kind == GraphNode::Kind::kWait && nodes[i].slot == nodes[last].slot) {
      return true;
    }
  }
  return false;
}

}  // namespace

void Capture::add(GraphNode node) {
  std::lock_guard<std::mutex> lock(mutex_);
  nodes_.push_back(std::move(node));
}

int64_t Capture::add_record(int64_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t slot = slots_++;
  nodes_.push_back(GraphNode{GraphNode::Kind::kRecord, stream, nullptr, slot});
  return slot;
}

void Capture::join(int64_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  streams_.insert(stream);
}

void Capture::hold(std::function<void()> release) {
  std::lock_guard<std::mutex> lock(mutex_);
  held_.push_back(std::move(release));
}

Graph::~Graph() {
  for (auto& release : held_) release();
}

void Graph::replay(int64_t stream_id) const {
  TORCH_CHECK(!capture_underway(), "emulated NPU: a graph cannot be replayed while a capture is underway");
  std::vector<std::shared_ptr<Event>> events;
  for (int64_t i = 0; i < slots_; ++i) events.push_back(std::make_shared<Event>());
  for (const GraphNode& node : nodes_) {
    Worker& worker = stream(node.stream == origin_ ? stream_id : node.stream);
    switch (node.kind) {
      case GraphNode::Kind::kTask: worker.enqueue(node.task); break;
      case GraphNode::Kind::kLaunch: worker.enqueue_launch(node.task); break;
      case GraphNode::Kind::kRecord: {
        std::shared_ptr<Event> event = events[static_cast<size_t>(node.slot)];
        worker.enqueue([event] { event->complete(); });
        break;
      }
      case GraphNode::Kind::kWait: worker.wait_for(events[static_cast<size_t>(node.slot)]); break;
    }
  }
}

size_t Graph::launches() const {
  size_t count = 0;
  for (const GraphNode& node : nodes_) count += node.kind == GraphNode::Kind::kLaunch ? 1 : 0;
  return count;
}

void begin_capture(int64_t stream_id) {
  Worker& worker = stream(stream_id);
  auto capture = std::make_shared<Capture>(stream_id);
  capture->join(stream_id);
  {
    std::lock_guard<std::mutex> lock(active_mutex());
    TORCH_CHECK(!active(), "emulated NPU: a capture is already underway (one at a time here)");
    active() = capture;
  }
  // Outside active_mutex: a stream's wait takes its own lock first, then active_mutex.
  worker.set_capture(capture);
}

std::shared_ptr<Graph> end_capture(int64_t stream_id) {
  std::shared_ptr<Capture> capture;
  {
    std::lock_guard<std::mutex> lock(active_mutex());
    TORCH_CHECK(active() && active()->origin() == stream_id, "emulated NPU: no capture was begun on stream ",
                stream_id);
    capture.swap(active());
  }
  std::vector<GraphNode> nodes;
  std::set<int64_t> streams;
  std::vector<std::function<void()>> held;
  {
    std::lock_guard<std::mutex> lock(capture->mutex_);
    nodes.swap(capture->nodes_);
    streams = capture->streams_;
    held.swap(capture->held_);
  }
  for (int64_t id : streams) stream(id).set_capture(nullptr);
  for (int64_t id : streams) {
    if (id != stream_id && !joined_back(nodes, stream_id, id)) {
      for (auto& release : held) release();
      TORCH_CHECK(false, "emulated NPU: the capture on stream ", stream_id, " ended with stream ", id,
                  " not joined back to it");
    }
  }
  return std::make_shared<Graph>(stream_id, std::move(nodes), capture->slots_, std::move(held));
}

bool capture_underway() {
  std::lock_guard<std::mutex> lock(active_mutex());
  return active() != nullptr;
}

bool hold_while_capturing(const std::function<void()>& release) {
  std::shared_ptr<Capture> capture;
  {
    std::lock_guard<std::mutex> lock(active_mutex());
    capture = active();
  }
  if (!capture) return false;
  capture->hold(release);
  return true;
}

}  // namespace gemm_ar::emu
