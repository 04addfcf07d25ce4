// The emulated HCCL communicator (docs/decisions/0019-emulated-npu-runtime.md): a c10d backend for "npu" tensors
// whose collectives run gloo on CPU aliases of the same memory, and whose one-sided resources are windows in POSIX
// shared memory that every rank maps, described to the kernels by a MESH context or a RING op-resource block laid out
// as csrc/host/npu/hccl_context_layout.h says HCCL lays them out.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <mutex>
#include <string>
#include <vector>

namespace gemm_ar::emu {

// HCCL status codes the emulation returns (0 = HCCL_SUCCESS).
constexpr int32_t kHcclSuccess = 0;
constexpr int32_t kHcclBadParameter = 1;  // HCCL_E_PARA
constexpr int32_t kHcclInternal = 4;      // HCCL_E_INTERNAL

class EmulatedHccl final : public c10d::Backend {
 public:
  // `mesh`: the level-0 topology HCCL reports for this communicator (MESH, or RING as on A3).
  EmulatedHccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, c10::intrusive_ptr<c10d::Backend> gloo,
               bool mesh);
  ~EmulatedHccl() override;

  const std::string getBackendName() const override { return "emulated_hccl"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // HcclAllocComResourceByTiling: maps every rank's window (collective over the group, through the store) and
  // returns the MESH context or the RING op-resource block. Later calls return the same resources.
  int32_t alloc_comm_resource(const std::string& comm_name, const void* tiling, void** context);
  bool mesh() const { return mesh_; }

 private:
  int32_t map_windows(std::string* error);

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> gloo_;
  const bool mesh_;
  std::mutex mutex_;
  uint64_t window_bytes_ = 0;
  std::vector<void*> windows_;  // every rank's window as mapped in this process
  void* context_ = nullptr;     // what alloc_comm_resource returned
  std::vector<void*> owned_;    // context memory (device memory HCCL owns)
};

}  // namespace gemm_ar::emu
