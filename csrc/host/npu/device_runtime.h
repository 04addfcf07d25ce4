// The NPU host code's only way to the device (docs/decisions/0018-npu-device-runtime-seam.md): everything it needs
// from torch_npu, ACL and HCCL, at the level it uses it, so that another runtime (an emulated one, running the
// kernel simulator in CPU rank processes) can stand behind the same host logic.
//
// Two halves, each with one process-wide instance, defined by the implementation that is linked
// (device_queue_npu.cpp and device_control_npu.cpp on Ascend):
//  - DeviceQueue: what the per-call path may do. Nothing in it waits for the device or for a peer: it queues work on
//    streams, records and queries events, allocates from the caching allocators. Its NPU implementation is one of
//    the per-call sources tests/test_npu_per_call_sync.py checks.
//  - DeviceControl: setup (HCCL's one-sided resources, device info, streams of our own) and the calls that block
//    (waiting for an event, a stream or the device; copies that return after they landed). Per-call code never calls
//    it (the same test checks that too).
//
// Memory crosses as ATen tensors (device tensors on Ascend), streams as c10::Stream, everything else as opaque
// handles or plain values: no torch_npu, ACL or HCCL type appears here. C++17.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/util/ArrayRef.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace c10d {
class ProcessGroup;
}

namespace gemm_ar::npu {

// An event recorded on a stream; defined by the implementation (a null pointer is "no event").
struct DeviceEventImpl;
using DeviceEvent = std::shared_ptr<DeviceEventImpl>;

// A stream as the runtime creates it, before it is a c10::Stream (aclrtStream on Ascend): HCCL takes it as is.
using NativeStream = void*;
// An HCCL communicator handle (HcclComm on Ascend).
using HcclCommHandle = void*;

// The kernels of the fused path, one per launch shim (kernel_launch.h, sp_kernel_launch.h).
enum class Kernel { kGemmCompute, kGemmComm, kRsCompute, kRsComm, kAgCompute, kAgComm };

// Device properties the setup asks for.
enum class DeviceAttribute { kCubeCores, kAiCoreCores, kVectorCores };

class DeviceQueue {
 public:
  virtual ~DeviceQueue() = default;

  // Devices and streams.
  virtual int32_t current_device() = 0;
  virtual c10::Stream current_stream(int32_t device) = 0;
  // A stream created by DeviceControl::create_stream, as a c10::Stream of `device`.
  virtual c10::Stream native_stream(NativeStream stream, int32_t device) = 0;
  // Whether the current stream is being captured into a graph (no device wait).
  virtual bool capturing() = 0;

  // Memory from the caching allocators (device, or pinned host memory for asynchronous copies). Allocated for the
  // current stream; keep_alive extends a tensor's life to the work queued so far on another stream.
  virtual at::Tensor empty(c10::IntArrayRef sizes, const at::TensorOptions& options) = 0;
  virtual at::Tensor empty_pinned(int64_t bytes) = 0;
  virtual void keep_alive(const c10::Stream& stream, const at::Tensor& tensor) = 0;

  // Work queued on `stream`, run in order with everything else queued there.
  virtual void fill_zero(const c10::Stream& stream, const at::Tensor& tensor) = 0;
  // Host<->device (from or into pinned memory) and device<->device; `src` may be strided.
  virtual void copy_async(const c10::Stream& stream, const at::Tensor& dst, const at::Tensor& src) = 0;
  // A contiguous copy of `tensor` (itself when it already is contiguous).
  virtual at::Tensor contiguous(const c10::Stream& stream, const at::Tensor& tensor) = 0;
  // counter (int64 [1], device) += 1: the fused calls' epoch counter.
  virtual void increment_counter(const c10::Stream& stream, const at::Tensor& counter) = 0;
  // Launches `kernel` on `blocks` cores with the device address of its KernelArgs.
  virtual void launch(const c10::Stream& stream, Kernel kernel, uint32_t blocks, void* args_device) = 0;

  // Events. `timing`: the event can be measured (elapsed_ms).
  virtual DeviceEvent record(const c10::Stream& stream, bool timing = false) = 0;
  // `stream` runs nothing more until `event` completed; the host does not wait.
  virtual void stream_waits_for(const c10::Stream& stream, const DeviceEvent& event) = 0;
  // Whether the event completed (no waiting).
  virtual bool query(const DeviceEvent& event) = 0;
};

class DeviceControl {
 public:
  virtual ~DeviceControl() = default;

  // The group's HCCL backend for NPU tensors: false if it has none (then *backend_name names the one it has, if
  // any). Its communicator's name, as HCCL's one-sided API takes it (throws on failure).
  virtual bool has_hccl_backend(c10d::ProcessGroup& group, std::string* backend_name) = 0;
  virtual std::string hccl_comm_name(c10d::ProcessGroup& group, int32_t device) = 0;

  // HCCL's one-sided API (results are HCCL status codes, 0 = success). Empty when it is all there, else which
  // entry points are missing and where they were looked for.
  virtual std::string hccl_one_sided_missing() = 0;
  virtual int32_t hccl_topology_is_mesh(const std::string& comm_name, bool* mesh) = 0;
  virtual int32_t hccl_comm_handle(const std::string& comm_name, HcclCommHandle* comm) = 0;
  // Sets up the one-sided resources described by `tiling` (hccl_context_layout.h) on `stream`, which HCCL may keep
  // using; *context is the device address of the context (MESH) or op-resource block (RING) HCCL built.
  virtual int32_t hccl_alloc_comm_resource(HcclCommHandle comm, NativeStream stream, void* tiling, void** context) = 0;

  // Results are runtime status codes (0 = success).
  virtual int32_t device_info(int32_t device, DeviceAttribute attribute, int64_t* value) = 0;
  // The runtime's AI Core op-execute timeout; false when this runtime cannot say.
  virtual bool op_execute_timeout_ms(int64_t* ms) = 0;
  virtual int32_t create_stream(NativeStream* stream) = 0;
  virtual int32_t synchronize_stream(NativeStream stream) = 0;
  // Device memory to host memory, returning after the copy landed.
  virtual int32_t copy_to_host_now(void* host, const void* device, size_t bytes) = 0;
  // `tensor` copied to `device` / to the host, returning after the copy landed.
  virtual at::Tensor to_device_now(const at::Tensor& tensor, const c10::Device& device) = 0;
  virtual at::Tensor to_host_now(const at::Tensor& tensor) = 0;
  // dst = src (host<->device), returning after the copy landed.
  virtual void copy_now(const at::Tensor& dst, const at::Tensor& src) = 0;

  // Waits until the event completed / everything queued on every stream of `device` ran.
  virtual void wait(const DeviceEvent& event) = 0;
  virtual void synchronize_device(const c10::Device& device) = 0;
  // Milliseconds between two completed timing events.
  virtual double elapsed_ms(const DeviceEvent& start, const DeviceEvent& stop) = 0;
};

// The runtime's two halves.
DeviceQueue& device_queue();
DeviceControl& device_control();

}  // namespace gemm_ar::npu
