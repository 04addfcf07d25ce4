#include "emu_memory.h"

#include <ATen/ATen.h>

#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "emu_graph.h"
#include "emu_streams.h"

namespace gemm_ar::emu {
namespace {

constexpr size_t kAlignment = 512;  // the device allocator's alignment on Ascend

struct Block {
  void* ptr = nullptr;
  size_t bytes = 0;
  int64_t stream = 0;          // the allocation stream
  std::mutex mutex;            // guards `recorded`
  std::set<int64_t> recorded;  // keep_alive's streams
};

// Blocks waiting for their streams to pass the point where they were freed.
class Reaper {
 public:
  Reaper() : thread_([this] { run(); }) { thread_.detach(); }

  void release(Block* block) {
    std::vector<std::shared_ptr<Event>> events{stream(block->stream).marker()};
    {
      std::lock_guard<std::mutex> lock(block->mutex);
      for (int64_t id : block->recorded) events.push_back(stream(id).marker());
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pending_.emplace_back(block, std::move(events));
    }
    ready_.notify_one();
  }

 private:
  void run() {
    for (;;) {
      std::pair<Block*, std::vector<std::shared_ptr<Event>>> next;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return !pending_.empty(); });
        next = std::move(pending_.front());
        pending_.pop_front();
      }
      bool passed = true;
      for (const auto& event : next.second) passed = event->wait_for(wait_bound()) && passed;
      if (!passed) {
        // A stream that never gets there: the block is leaked rather than handed to a kernel still using it.
        set_device_error("a freed block's streams did not reach its release point within the bound");
        continue;
      }
      std::memset(next.first->ptr, 0xFF, next.first->bytes);
      std::free(next.first->ptr);
      delete next.first;
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::pair<Block*, std::vector<std::shared_ptr<Event>>>> pending_;
  std::thread thread_;
};

Reaper& reaper() {
  static auto* r = new Reaper();  // never destroyed: frees may come while static destructors run
  return *r;
}

// A block freed while a graph is being captured stays allocated until the graph goes: its replays use it again.
void free_block(void* context) {
  auto* block = static_cast<Block*>(context);
  if (hold_while_capturing([block] { reaper().release(block); })) return;
  reaper().release(block);
}

struct EmulatedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
    const c10::Device device(c10::DeviceType::PrivateUse1, 0);
    if (bytes == 0) return {nullptr, nullptr, &c10::detail::deleteNothing, device};
    auto* block = new Block();
    block->bytes = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    block->ptr = std::aligned_alloc(kAlignment, block->bytes);
    TORCH_CHECK(block->ptr != nullptr, "emulated NPU: out of memory allocating ", bytes, " bytes");
    // Never-written device memory holds whatever was there: not zeros.
    std::memset(block->ptr, 0xA5, block->bytes);
    block->stream = current_stream_id();
    return {block->ptr, block, &free_block, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

}  // namespace

c10::Allocator& device_allocator() {
  static auto* allocator = new EmulatedAllocator();
  return *allocator;
}

void keep_alive(int64_t stream_id, const at::Tensor& tensor) {
  const c10::DataPtr& data = tensor.storage().data_ptr();
  if (data.get_deleter() != &free_block) return;  // not a block of ours (an empty tensor)
  auto* block = static_cast<Block*>(data.get_context());
  std::lock_guard<std::mutex> lock(block->mutex);
  if (stream_id != block->stream) block->recorded.insert(stream_id);
}

at::Tensor cpu_alias(const at::Tensor& tensor) {
  if (!tensor.device().is_privateuseone()) return tensor;
  if (tensor.numel() == 0) return at::empty(tensor.sizes(), tensor.options().device(at::kCPU));
  return at::from_blob(tensor.data_ptr(), tensor.sizes(), tensor.strides(), tensor.options().device(at::kCPU));
}

}  // namespace gemm_ar::emu
