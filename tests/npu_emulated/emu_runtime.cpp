// DeviceQueue and DeviceControl (csrc/host/npu/device_runtime.h) on the emulated runtime
// (docs/decisions/0019-emulated-npu-runtime.md): what device_queue_npu.cpp and device_control_npu.cpp do with
// torch_npu, ACL and HCCL, done with the emulated streams, memory and communicator. Every operation the host queues
// on a stream runs on that stream's worker.
#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "emu_hccl.h"
#include "emu_memory.h"
#include "emu_settings.h"
#include "emu_streams.h"
#include "gemm_ar/kernel_args.hpp"
#include "npu/device_runtime.h"
#include "sim_kernels.h"

namespace gemm_ar::npu {

struct DeviceEventImpl {
  std::shared_ptr<emu::Event> event;
};

namespace {

constexpr int32_t kAclSuccess = 0;
constexpr int32_t kAclStreamSyncFailed = 507000;  // any nonzero runtime status: the host reports it as it is

// The emulated device's cores (emu_settings.h): few, since every block is a thread of a machine shared by every rank.
int64_t cube_cores() { return emu::settings::cube_cores(); }
int64_t vector_cores() { return emu::settings::vector_cores(); }

// The device's cores of one type, handed to launches: a kernel's blocks each get a core of their own for the whole
// launch (concurrent kernels never share one), and each core keeps its cache lines across launches.
class CorePool {
 public:
  explicit CorePool(int64_t count) {
    for (int64_t i = 0; i < count; ++i) free_.push_back(emu::sim::new_core());
    total_ = free_.size();
  }
  std::vector<emu::sim::Core*> acquire(uint32_t blocks) {
    TORCH_CHECK(blocks <= total_, "a launch of ", blocks, " blocks on a device with ", total_, " such cores");
    std::unique_lock<std::mutex> lock(mutex_);
    TORCH_CHECK(freed_.wait_for(lock, emu::wait_bound(), [&] { return free_.size() >= blocks; }), "a launch of ",
                blocks, " blocks found no free cores within the bound");
    std::vector<emu::sim::Core*> cores(free_.end() - blocks, free_.end());
    free_.resize(free_.size() - blocks);
    return cores;
  }
  void release(const std::vector<emu::sim::Core*>& cores) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      free_.insert(free_.end(), cores.begin(), cores.end());
    }
    freed_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable freed_;
  std::vector<emu::sim::Core*> free_;
  size_t total_ = 0;
};

// A launch's cores, given back when the launch ends, also when the kernel threw.
class CoreLease {
 public:
  CoreLease(CorePool& pool, uint32_t blocks) : pool_(pool), cores_(pool.acquire(blocks)) {}
  ~CoreLease() { pool_.release(cores_); }
  CoreLease(const CoreLease&) = delete;
  CoreLease& operator=(const CoreLease&) = delete;
  emu::sim::Core* const* data() const { return cores_.data(); }

 private:
  CorePool& pool_;
  const std::vector<emu::sim::Core*> cores_;
};

// The simulator names the kernels by number (sim_kernels.h, plain types for its C++20 side): the same numbers.
static_assert(static_cast<int>(Kernel::kGemmCompute) == emu::sim::kGemmCompute &&
                  static_cast<int>(Kernel::kGemmComm) == emu::sim::kGemmComm &&
                  static_cast<int>(Kernel::kRsCompute) == emu::sim::kRsCompute &&
                  static_cast<int>(Kernel::kRsComm) == emu::sim::kRsComm &&
                  static_cast<int>(Kernel::kAgCompute) == emu::sim::kAgCompute &&
                  static_cast<int>(Kernel::kAgComm) == emu::sim::kAgComm && emu::sim::kKernelCount == 6,
              "sim_kernels.h's KernelId must follow npu::Kernel (device_runtime.h)");

// Watches that a communicator's calls never run at once: the kernels of one call (which share their KernelArgs) may,
// the kernels of two calls naming the same CommContext may not. Read at kernel start, as the kernels read them.
class CallOverlapWatch {
 public:
  // The launch's communicator context, from the KernelArgs in device memory.
  static uint64_t context_of(const void* args_device) {
    KernelArgs args;
    std::memcpy(&args, args_device, sizeof(args));
    return args.comm_ctx;
  }
  void start(uint64_t context, const void* call) {
    std::lock_guard<std::mutex> lock(mutex_);
    Running& running = running_[context];
    if (running.kernels > 0 && running.call != call) {
      emu::count_overlapping_kernel();
    } else {
      running.call = call;
    }
    ++running.kernels;
  }
  void end(uint64_t context) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (--running_[context].kernels == 0) running_.erase(context);
  }

 private:
  struct Running {
    const void* call = nullptr;
    int kernels = 0;
  };
  std::mutex mutex_;
  std::map<uint64_t, Running> running_;
};

CallOverlapWatch& call_overlap_watch() {
  static auto* watch = new CallOverlapWatch();
  return *watch;
}

// A running kernel, in the watch from its start to its end (also when it threw).
class WatchedKernel {
 public:
  explicit WatchedKernel(const void* args_device) : context_(CallOverlapWatch::context_of(args_device)) {
    call_overlap_watch().start(context_, args_device);
  }
  ~WatchedKernel() { call_overlap_watch().end(context_); }
  WatchedKernel(const WatchedKernel&) = delete;
  WatchedKernel& operator=(const WatchedKernel&) = delete;

 private:
  const uint64_t context_;
};

CorePool& cores_for(int kernel) {
  static auto* cube = new CorePool(cube_cores());
  static auto* vector = new CorePool(vector_cores());
  return emu::sim::on_cube_cores(kernel) ? *cube : *vector;
}

emu::Worker& worker_of(const c10::Stream& stream) {
  TORCH_CHECK(stream.device_type() == c10::DeviceType::PrivateUse1, "not an emulated NPU stream: ", stream);
  return emu::stream(stream.id());
}

c10::Device the_device() { return c10::Device(c10::DeviceType::PrivateUse1, 0); }

class EmulatedQueue final : public DeviceQueue {
 public:
  int32_t current_device() override { return 0; }
  c10::Stream current_stream(int32_t) override {
    return c10::Stream(c10::Stream::UNSAFE, the_device(), emu::current_stream_id());
  }
  c10::Stream native_stream(NativeStream stream, int32_t) override {
    return c10::Stream(c10::Stream::UNSAFE, the_device(), static_cast<emu::Worker*>(stream)->id());
  }
  bool capturing() override { return emu::stream(emu::current_stream_id()).capturing(); }

  at::Tensor empty(c10::IntArrayRef sizes, const at::TensorOptions& options) override {
    return at::empty(sizes, options);
  }
  // Pinned memory is host memory here; a queued copy keeps its tensors until it ran, as the caching host allocator
  // keeps a block until the copy's event completed.
  at::Tensor empty_pinned(int64_t bytes) override { return at::empty({bytes}, at::TensorOptions().dtype(at::kByte)); }
  void keep_alive(const c10::Stream& stream, const at::Tensor& tensor) override {
    emu::keep_alive(worker_of(stream).id(), tensor);
  }

  void fill_zero(const c10::Stream& stream, const at::Tensor& tensor) override {
    worker_of(stream).enqueue([tensor] { emu::cpu_alias(tensor).zero_(); });
  }
  void copy_async(const c10::Stream& stream, const at::Tensor& dst, const at::Tensor& src) override {
    TORCH_CHECK(dst.sizes() == src.sizes(), "copy_async: sizes ", dst.sizes(), " and ", src.sizes());
    worker_of(stream).enqueue([dst, src] { emu::cpu_alias(dst).copy_(emu::cpu_alias(src)); });
  }
  at::Tensor contiguous(const c10::Stream& stream, const at::Tensor& tensor) override {
    if (tensor.is_contiguous()) return tensor;
    at::Tensor out;
    {
      c10::StreamGuard on_stream(stream);  // allocated for `stream`, as tensor.contiguous() under a stream guard is
      out = at::empty(tensor.sizes(), tensor.options());
    }
    copy_async(stream, out, tensor);
    return out;
  }
  void increment_counter(const c10::Stream& stream, const at::Tensor& counter) override {
    emu::Worker& worker = worker_of(stream);
    if (worker.capturing()) {  // a node of the graph: runs only in replays
      worker.enqueue([counter] {
        if (!emu::replays_skip_counter()) emu::cpu_alias(counter).add_(1);
      });
      return;
    }
    worker.enqueue([counter] { emu::cpu_alias(counter).add_(1); });
  }
  void launch(const c10::Stream& stream, Kernel kernel, uint32_t blocks, void* args_device) override {
    const int id = static_cast<int>(kernel);
    TORCH_CHECK(id >= 0 && id < emu::sim::kKernelCount, "unknown kernel ", id);
    worker_of(stream).enqueue_launch([id, blocks, args_device] {
      const WatchedKernel watched(args_device);
      const CoreLease cores(cores_for(id), blocks);
      emu::sim::run_kernel(id, blocks, cores.data(), args_device);
    });
  }

  DeviceEvent record(const c10::Stream& stream, bool) override {
    auto event = std::make_shared<DeviceEventImpl>();
    event->event = worker_of(stream).record();
    return event;
  }
  void stream_waits_for(const c10::Stream& stream, const DeviceEvent& event) override {
    worker_of(stream).wait_for(event->event);
  }
  bool query(const DeviceEvent& event) override {
    TORCH_CHECK(event->event->slot < 0, "emulated NPU: an event recorded during a capture cannot be queried");
    return event->event->query();
  }
};

// Communicator names handed out by hccl_comm_name, and the backends they name.
std::mutex& comm_mutex() {
  static auto* mutex = new std::mutex();
  return *mutex;
}
std::map<std::string, c10::intrusive_ptr<emu::EmulatedHccl>>& comms() {
  static auto* all = new std::map<std::string, c10::intrusive_ptr<emu::EmulatedHccl>>();
  return *all;
}

c10::intrusive_ptr<emu::EmulatedHccl> emulated_hccl(c10d::ProcessGroup& group, std::string* backend_name) {
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = group.getBackend(c10::DeviceType::PrivateUse1);
  } catch (const std::exception&) {
  }
  auto hccl = c10::dynamic_intrusive_pointer_cast<emu::EmulatedHccl>(backend);
  if (!hccl && backend_name != nullptr) *backend_name = backend ? backend->getBackendName() : "";
  return hccl;
}

class EmulatedControl final : public DeviceControl {
 public:
  bool has_hccl_backend(c10d::ProcessGroup& group, std::string* backend_name) override {
    return static_cast<bool>(emulated_hccl(group, backend_name));
  }
  std::string hccl_comm_name(c10d::ProcessGroup& group, int32_t) override {
    auto hccl = emulated_hccl(group, nullptr);
    TORCH_CHECK(hccl, "group '", group.getGroupName(), "' has no HCCL backend for NPU tensors");
    const std::string name = "emulated_hccl_" + group.getGroupName();
    std::lock_guard<std::mutex> lock(comm_mutex());
    comms()[name] = hccl;
    return name;
  }
  std::string hccl_one_sided_missing() override { return ""; }
  int32_t hccl_topology_is_mesh(const std::string& comm_name, bool* mesh) override {
    std::lock_guard<std::mutex> lock(comm_mutex());
    auto found = comms().find(comm_name);
    if (found == comms().end()) return emu::kHcclBadParameter;
    *mesh = found->second->mesh();
    return emu::kHcclSuccess;
  }
  int32_t hccl_comm_handle(const std::string& comm_name, HcclCommHandle* comm) override {
    std::lock_guard<std::mutex> lock(comm_mutex());
    auto found = comms().find(comm_name);
    if (found == comms().end()) return emu::kHcclBadParameter;
    *comm = found->second.get();
    return emu::kHcclSuccess;
  }
  int32_t hccl_alloc_comm_resource(HcclCommHandle comm, NativeStream stream, void* tiling, void** context) override {
    if (comm == nullptr || stream == nullptr || tiling == nullptr) return emu::kHcclBadParameter;
    auto* hccl = static_cast<emu::EmulatedHccl*>(comm);
    std::string comm_name;
    {
      std::lock_guard<std::mutex> lock(comm_mutex());
      for (const auto& entry : comms()) {
        if (entry.second.get() == hccl) comm_name = entry.first;
      }
    }
    if (comm_name.empty()) return emu::kHcclBadParameter;
    return hccl->alloc_comm_resource(comm_name, tiling, context);
  }

  int32_t device_info(int32_t device, DeviceAttribute attribute, int64_t* value) override {
    if (device != 0) return 107001;  // ACL_ERROR_RT_INVALID_DEVICEID-like: one device
    switch (attribute) {
      case DeviceAttribute::kCubeCores:
      case DeviceAttribute::kAiCoreCores: *value = cube_cores(); break;
      case DeviceAttribute::kVectorCores: *value = vector_cores(); break;
    }
    return kAclSuccess;
  }
  bool op_execute_timeout_ms(int64_t* ms) override {
    *ms = emu::settings::aicore_timeout_ms();
    return true;
  }
  int32_t create_stream(NativeStream* stream) override {
    *stream = &emu::new_stream();
    return kAclSuccess;
  }
  int32_t synchronize_stream(NativeStream stream) override {
    emu::count_host_synchronisation();
    try {
      emu::synchronize(*static_cast<emu::Worker*>(stream));
    } catch (const std::exception&) {
      return kAclStreamSyncFailed;
    }
    return kAclSuccess;
  }
  int32_t copy_to_host_now(void* host, const void* device, size_t bytes) override {
    emu::count_host_synchronisation();
    std::memcpy(host, device, bytes);
    return kAclSuccess;
  }
  at::Tensor to_device_now(const at::Tensor& tensor, const c10::Device& device) override {
    emu::count_host_synchronisation();
    return tensor.to(device);
  }
  at::Tensor to_host_now(const at::Tensor& tensor) override {
    emu::count_host_synchronisation();
    return tensor.cpu();
  }
  void copy_now(const at::Tensor& dst, const at::Tensor& src) override {
    emu::count_host_synchronisation();
    dst.copy_(src, /*non_blocking=*/false);
  }

  void wait(const DeviceEvent& event) override {
    emu::count_host_synchronisation();
    TORCH_CHECK(event->event->slot < 0, "emulated NPU: the host waits for an event recorded during a capture");
    TORCH_CHECK(event->event->wait_for(emu::wait_bound()), "emulated NPU: an event did not complete within ",
                emu::wait_bound().count() / 1000, " s (GEMM_AR_EMU_WAIT_S)");
    emu::report_device_error();
  }
  void synchronize_device(const c10::Device&) override {
    emu::count_host_synchronisation();
    emu::synchronize_all();
  }
  double elapsed_ms(const DeviceEvent& start, const DeviceEvent& stop) override {
    TORCH_CHECK(start->event->query() && stop->event->query(), "elapsed_ms of an event that did not complete");
    return std::chrono::duration<double, std::milli>(stop->event->when - start->event->when).count();
  }
};

}  // namespace

DeviceQueue& device_queue() {
  static auto* queue = new EmulatedQueue();
  return *queue;
}

DeviceControl& device_control() {
  static auto* control = new EmulatedControl();
  return *control;
}

}  // namespace gemm_ar::npu
