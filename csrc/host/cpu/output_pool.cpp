#include "cpu/output_pool.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "common/current_op.h"
#include "common/settings.h"

namespace gemm_ar::cpu {
namespace {

constexpr size_t kAlignment = 64;

class OutputPool final : public c10::Allocator {
 public:
  struct Block {
    void* data;
    size_t bytes;
  };

  static OutputPool& instance() {
    static auto* pool = new OutputPool();  // never destroyed: tensors may outlive static destruction
    return *pool;
  }

  c10::DataPtr allocate(size_t bytes) override {
    if (bytes == 0) return c10::DataPtr(nullptr, nullptr, &release, c10::Device(c10::kCPU));
    Block* block = take(bytes);
    if (block == nullptr) {
      void* data = nullptr;
      TORCH_CHECK(posix_memalign(&data, kAlignment, bytes) == 0, current_op(), ": out of memory allocating ", bytes,
                  " bytes for the output");
      block = new Block{data, bytes};
    }
    return c10::DataPtr(block->data, block, &release, c10::Device(c10::kCPU));
  }

  void trim() {
    std::unordered_map<size_t, std::vector<Block*>> free;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      free.swap(free_);
      cached_ = 0;
    }
    for (auto& [bytes, blocks] : free) {
      for (Block* block : blocks) {
        std::free(block->data);
        delete block;
      }
    }
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

 private:
  OutputPool() : limit_(static_cast<size_t>(env_int(Setting::kOutputCacheMb, 512, 0, 1 << 20)) << 20) {}

  Block* take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.find(bytes);
    if (it == free_.end() || it->second.empty()) return nullptr;
    Block* block = it->second.back();
    it->second.pop_back();
    cached_ -= bytes;
    return block;
  }

  static void release(void* context) {
    if (context == nullptr) return;
    auto* block = static_cast<Block*>(context);
    OutputPool& pool = instance();
    {
      std::lock_guard<std::mutex> lock(pool.mutex_);
      if (pool.cached_ + block->bytes <= pool.limit_) {
        pool.free_[block->bytes].push_back(block);
        pool.cached_ += block->bytes;
        return;
      }
    }
    std::free(block->data);
    delete block;
  }

  std::mutex mutex_;
  std::unordered_map<size_t, std::vector<Block*>> free_;
  size_t cached_ = 0;
  const size_t limit_;
};

}  // namespace

at::Tensor pooled_empty(int64_t rows, int64_t cols, at::ScalarType dtype) {
  return at::detail::empty_generic({rows, cols}, &OutputPool::instance(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   dtype, std::nullopt);
}

}  // namespace gemm_ar::cpu

namespace gemm_ar::cpu {

void trim_output_pool() { OutputPool::instance().trim(); }

}  // namespace gemm_ar::cpu
