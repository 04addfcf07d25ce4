#include "emu_hccl.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "emu_memory.h"
#include "emu_settings.h"
#include "emu_streams.h"
#include "gemm_ar/kernel_args.hpp"
#include "npu/hccl_context_layout.h"

namespace gemm_ar::emu {
namespace {

namespace layout = gemm_ar::npu::hccl_layout;

std::vector<at::Tensor> aliases(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : tensors) out.push_back(cpu_alias(t));
  return out;
}

// The collective runs in order with the current stream and has landed when it returns (a stronger order than a
// device collective's, which the host code must not need less of).
c10::intrusive_ptr<c10d::Work> finished(const c10::intrusive_ptr<c10d::Work>& work) {
  work->wait();
  return work;
}

// Every collective of the group is a host synchronisation (counted), in order with the current stream.
void begin_collective() {
  count_host_synchronisation();
  synchronize(stream(current_stream_id()));
}

// HCCL_BUFFSIZE (MB) as HCCL reads it.
uint64_t window_bytes_from_env() { return static_cast<uint64_t>(settings::window_megabytes()) << 20; }

std::string random_token() {
  std::random_device device;
  std::mt19937_64 rng((static_cast<uint64_t>(device()) << 32) ^ device() ^ static_cast<uint64_t>(getpid()));
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(rng()));
  return text;
}

void* map_shared(const std::string& name, uint64_t bytes, bool create, std::string* error) {
  const int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) {
    *error = "shm_open(" + name + ") failed: " + std::strerror(errno);
    return nullptr;
  }
  if (create && ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    *error = "ftruncate(" + name + ") failed: " + std::strerror(errno);
    close(fd);
    return nullptr;
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    *error = "mmap(" + name + ") failed: " + std::strerror(errno);
    return nullptr;
  }
  return p;
}

bool tiling_is_batch_write(const void* tiling, const std::string& comm_name) {
  layout::Mc2TilingV2 t;
  std::memcpy(&t, tiling, sizeof(t));
  const std::string group(t.cc.groupName, strnlen(t.cc.groupName, sizeof(t.cc.groupName)));
  const std::string alg(t.cc.algConfig, strnlen(t.cc.algConfig, sizeof(t.cc.algConfig)));
  return t.init.version == layout::kInitTilingVersion && t.init.mc2HcommCnt == 1 &&
         t.init.offset[0] == offsetof(layout::Mc2TilingV2, cc) && t.init.commBlockNum > 0 &&
         t.cc.opType == layout::kOpTypeBatchWrite && t.cc.commEngine == layout::kCommEngineAiv && group == comm_name &&
         alg == layout::kAlgConfigFullMesh;
}

// Negative control (tests only): GEMM_AR_EMU_FAULT_WINDOW_SHIFT=B makes the context this rank gets name the next
// rank's window B bytes past where it is, as a host that read HCCL's layout wrongly would.
uint64_t fault_window_shift() { return static_cast<uint64_t>(settings::fault_window_shift()); }

}  // namespace

EmulatedHccl::EmulatedHccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                           c10::intrusive_ptr<c10d::Backend> gloo, bool mesh)
    : c10d::Backend(rank, size), store_(c10::make_intrusive<c10d::PrefixStore>("emulated_hccl", store)),
      gloo_(std::move(gloo)), mesh_(mesh) {}

// The windows stay mapped: kernels queued before the group was destroyed may still write into them, as HCCL keeps
// its windows until the communicator is gone.
EmulatedHccl::~EmulatedHccl() = default;

c10::intrusive_ptr<c10d::Work> EmulatedHccl::broadcast(std::vector<at::Tensor>& tensors,
                                                       const c10d::BroadcastOptions& opts) {
  begin_collective();
  auto cpu = aliases(tensors);
  return finished(gloo_->broadcast(cpu, opts));
}

c10::intrusive_ptr<c10d::Work> EmulatedHccl::allreduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::AllreduceOptions& opts) {
  begin_collective();
  auto cpu = aliases(tensors);
  return finished(gloo_->allreduce(cpu, opts));
}

c10::intrusive_ptr<c10d::Work> EmulatedHccl::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::AllgatherOptions& opts) {
  begin_collective();
  std::vector<std::vector<at::Tensor>> out;
  for (const auto& list : outputs) out.push_back(aliases(list));
  auto in = aliases(inputs);
  return finished(gloo_->allgather(out, in, opts));
}

c10::intrusive_ptr<c10d::Work> EmulatedHccl::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                             const c10d::AllgatherOptions& opts) {
  begin_collective();
  at::Tensor out = cpu_alias(output), in = cpu_alias(input);
  return finished(gloo_->_allgather_base(out, in, opts));
}

c10::intrusive_ptr<c10d::Work> EmulatedHccl::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                            std::vector<std::vector<at::Tensor>>& inputs,
                                                            const c10d::ReduceScatterOptions& opts) {
  begin_collective();
  auto out = aliases(outputs);
  std::vector<std::vector<at::Tensor>> in;
  for (const auto& list : inputs) in.push_back(aliases(list));
  return finished(gloo_->reduce_scatter(out, in, opts));
}

c10::intrusive_ptr<c10d::Work> EmulatedHccl::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                  const c10d::ReduceScatterOptions& opts) {
  begin_collective();
  at::Tensor out = cpu_alias(output), in = cpu_alias(input);
  return finished(gloo_->_reduce_scatter_base(out, in, opts));
}

c10::intrusive_ptr<c10d::Work> EmulatedHccl::barrier(const c10d::BarrierOptions& opts) {
  begin_collective();
  return finished(gloo_->barrier(opts));
}

int32_t EmulatedHccl::map_windows(std::string* error) {
  const int rank = getRank(), world = getSize();
  window_bytes_ = window_bytes_from_env();
  // A per-run random token: names of an earlier run that died can never be taken for this run's.
  const std::string own = "/gemm_ar_emu_" + std::to_string(getpid()) + "_" + random_token();
  void* mine = map_shared(own, window_bytes_, /*create=*/true, error);
  if (mine == nullptr) return kHcclInternal;
  // Whatever an earlier user of the memory left: HCCL's windows are never zeroed for us. GEMM_AR_EMU_WINDOW_FILL=zero
  // leaves them zeroed instead (to tell stale bytes from other causes).
  if (!settings::zero_windows()) {
    std::mt19937_64 rng(std::random_device{}());
    auto* words = static_cast<uint64_t*>(mine);
    for (uint64_t i = 0; i < window_bytes_ / sizeof(uint64_t); ++i) words[i] = rng();
  }
  windows_.assign(world, nullptr);
  windows_[rank] = mine;
  int32_t status = kHcclSuccess;
  try {
    store_->set("window/" + std::to_string(rank), std::vector<uint8_t>(own.begin(), own.end()));
    for (int peer = 0; peer < world && status == kHcclSuccess; ++peer) {
      if (peer == rank) continue;
      const std::string key = "window/" + std::to_string(peer);
      store_->wait({key}, wait_bound());
      const std::vector<uint8_t> name = store_->get(key);
      windows_[peer] = map_shared(std::string(name.begin(), name.end()), window_bytes_, /*create=*/false, error);
      if (windows_[peer] == nullptr) status = kHcclInternal;
    }
    // Every rank mapped every window (or gave up): the names can go, so nothing stays in /dev/shm.
    store_->add("mapped", 1);
    const auto deadline = std::chrono::steady_clock::now() + wait_bound();
    while (store_->add("mapped", 0) < world) {
      if (std::chrono::steady_clock::now() > deadline) {
        *error = "not every rank mapped the windows within the bound";
        status = kHcclInternal;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  } catch (const std::exception& e) {
    *error = e.what();
    status = kHcclInternal;
  }
  shm_unlink(own.c_str());
  return status;
}

int32_t EmulatedHccl::alloc_comm_resource(const std::string& comm_name, const void* tiling, void** context) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!tiling_is_batch_write(tiling, comm_name)) return kHcclBadParameter;
  if (context_ != nullptr) {
    *context = context_;
    return kHcclSuccess;
  }
  std::string error;
  const int32_t status = map_windows(&error);
  if (status != kHcclSuccess) {
    TORCH_WARN("emulated HCCL: ", error);
    return status;
  }
  const int rank = getRank(), world = getSize();
  const int shifted = (rank + 1) % world;
  const uint64_t shift = fault_window_shift();
  const auto address = [&](int peer) {
    return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(windows_[peer])) + (peer == shifted ? shift : 0);
  };
  if (mesh_) {
    // MESH: the context the kernels read, in device memory HCCL owns.
    CommContext ctx{};
    ctx.rank_id = static_cast<uint32_t>(rank);
    ctx.rank_num = static_cast<uint32_t>(world);
    ctx.win_size = window_bytes_;
    for (int p = 0; p < world; ++p) ctx.windows_in[p] = address(p);
    void* memory = std::aligned_alloc(512, (sizeof(ctx) + 511) / 512 * 512);
    std::memcpy(memory, &ctx, sizeof(ctx));
    owned_.push_back(memory);
    context_ = memory;
  } else {
    // RING: the op-resource block, this rank's windows in its head and one rank-relation record per peer.
    const size_t block_bytes = sizeof(layout::OpResParam) + static_cast<size_t>(world) * sizeof(layout::RemoteResPtr);
    auto* block = static_cast<uint8_t*>(std::aligned_alloc(512, (block_bytes + 511) / 512 * 512));
    std::memset(block, 0, block_bytes);
    owned_.push_back(block);
    layout::OpResParam head{};
    head.localUsrRankId = static_cast<uint32_t>(rank);
    head.rankSize = static_cast<uint32_t>(world);
    head.winSize = window_bytes_;
    head.localWindowsIn = address(rank);
    std::strncpy(head.hcomId, comm_name.c_str(), sizeof(head.hcomId) - 1);
    head.remoteResNum = static_cast<uint32_t>(world);
    std::memcpy(block, &head, offsetof(layout::OpResParam, remoteRes));
    for (int p = 0; p < world; ++p) {
      if (p == rank) continue;
      auto* relation = static_cast<layout::RankRelationResV2*>(std::aligned_alloc(64, 64 * 2));
      std::memset(relation, 0, sizeof(*relation));
      relation->remoteUsrRankId = static_cast<uint32_t>(p);
      relation->remoteWorldRank = static_cast<uint32_t>(p);
      relation->windowsIn = address(p);
      owned_.push_back(relation);
      layout::RemoteResPtr remote{};
      remote.nextDevicePtr = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(relation));
      std::memcpy(block + offsetof(layout::OpResParam, remoteRes) + static_cast<size_t>(p) * sizeof(remote), &remote,
                  sizeof(remote));
    }
    context_ = block;
  }
  count_context(mesh_);
  *context = context_;
  return kHcclSuccess;
}

}  // namespace gemm_ar::emu
