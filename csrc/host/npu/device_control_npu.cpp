// DeviceControl on Ascend (npu/device_runtime.h): each function is the torch_npu, ACL or HCCL call the host code
// made before the seam. Setup and the calls that wait for the device; never reached from the per-call path.
#include <acl/acl.h>
#include <torch_npu/csrc/core/npu/NPUFunctions.h>
#include <torch_npu/csrc/core/npu/NPUGuard.h>
#include <torch_npu/csrc/distributed/ProcessGroupHCCL.hpp>

#include <dlfcn.h>

#include "npu/device_event_npu.h"
#include "npu/device_runtime.h"
#include "npu/hccl_symbols.h"

namespace gemm_ar::npu {
namespace {

// The seam's status codes are ACL's and HCCL's own; the host logic takes 0 for success.
static_assert(ACL_SUCCESS == 0 && HCCL_SUCCESS == 0, "the host logic takes status 0 for success");

c10d_npu::ProcessGroupHCCL* hccl_backend(c10d::ProcessGroup& group, std::string* backend_name) {
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = group.getBackend(c10::DeviceType::PrivateUse1);
  } catch (const std::exception&) {
  }
  auto* hccl = dynamic_cast<c10d_npu::ProcessGroupHCCL*>(backend.get());
  if (hccl == nullptr && backend_name != nullptr) *backend_name = backend ? backend->getBackendName() : "";
  return hccl;
}

aclrtDevAttr acl_attribute(DeviceAttribute attribute) {
  switch (attribute) {
    case DeviceAttribute::kCubeCores: return ACL_DEV_ATTR_CUBE_CORE_NUM;
    case DeviceAttribute::kAiCoreCores: return ACL_DEV_ATTR_AICORE_CORE_NUM;
    case DeviceAttribute::kVectorCores: return ACL_DEV_ATTR_VECTOR_CORE_NUM;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown device attribute ", static_cast<int>(attribute));
}

class NpuDeviceControl final : public DeviceControl {
 public:
  bool has_hccl_backend(c10d::ProcessGroup& group, std::string* backend_name) override {
    return hccl_backend(group, backend_name) != nullptr;
  }
  // torch_npu only uses the rank argument to check that rank % device_count is the current device; passing the
  // device index itself satisfies that check for every rank layout.
  std::string hccl_comm_name(c10d::ProcessGroup& group, int32_t device) override {
    c10d_npu::ProcessGroupHCCL* hccl = hccl_backend(group, nullptr);
    TORCH_CHECK(hccl != nullptr, "group '", group.getGroupName(), "' has no HCCL backend for NPU tensors");
    return hccl->getHcclCommName(device);
  }

  std::string hccl_one_sided_missing() override { return hccl_internal_api().missing; }
  int32_t hccl_topology_is_mesh(const std::string& comm_name, bool* mesh) override {
    CommTopo topo = COMM_TOPO_RESERVED;
    const HcclResult result =
        hccl_internal_api().get_l0_topo_type(comm_name.c_str(), &topo, kTopoQueryWithoutSetDevice);
    *mesh = topo == COMM_TOPO_1DMESH;
    return static_cast<int32_t>(result);
  }
  int32_t hccl_comm_handle(const std::string& comm_name, HcclCommHandle* comm) override {
    HcclComm handle = nullptr;
    const HcclResult result = hccl_internal_api().get_comm_handle_by_group(comm_name.c_str(), &handle);
    *comm = handle;
    return static_cast<int32_t>(result);
  }
  int32_t hccl_alloc_comm_resource(HcclCommHandle comm, NativeStream stream, void* tiling, void** context) override {
    return static_cast<int32_t>(hccl_internal_api().alloc_com_resource_by_tiling(static_cast<HcclComm>(comm), stream,
                                                                                 tiling, context));
  }

  int32_t device_info(int32_t device, DeviceAttribute attribute, int64_t* value) override {
    return aclrtGetDeviceInfo(static_cast<uint32_t>(device), acl_attribute(attribute), value);
  }
  // aclrtGetOpExecuteTimeout exists only in newer CANN, so it is looked up at run time.
  bool op_execute_timeout_ms(int64_t* ms) override {
    using GetTimeout = aclError (*)(uint32_t*);
    auto get = reinterpret_cast<GetTimeout>(dlsym(RTLD_DEFAULT, "aclrtGetOpExecuteTimeout"));
    uint32_t value = 0;
    if (get == nullptr || get(&value) != ACL_SUCCESS) return false;
    *ms = static_cast<int64_t>(value);
    return true;
  }
  int32_t create_stream(NativeStream* stream) override {
    aclrtStream created = nullptr;
    const aclError status = aclrtCreateStream(&created);
    *stream = created;
    return status;
  }
  int32_t synchronize_stream(NativeStream stream) override {
    return aclrtSynchronizeStream(static_cast<aclrtStream>(stream));
  }
  int32_t copy_to_host_now(void* host, const void* device, size_t bytes) override {
    return aclrtMemcpy(host, bytes, device, bytes, ACL_MEMCPY_DEVICE_TO_HOST);
  }
  at::Tensor to_device_now(const at::Tensor& tensor, const c10::Device& device) override { return tensor.to(device); }
  at::Tensor to_host_now(const at::Tensor& tensor) override { return tensor.cpu(); }
  void copy_now(const at::Tensor& dst, const at::Tensor& src) override { dst.copy_(src, /*non_blocking=*/false); }

  void wait(const DeviceEvent& event) override { event->event.synchronize(); }
  void synchronize_device(const c10::Device& device) override {
    c10_npu::NPUGuard guard(device);
    c10_npu::device_synchronize();
  }
  double elapsed_ms(const DeviceEvent& start, const DeviceEvent& stop) override {
    return static_cast<double>(start->event.elapsed_time(stop->event));
  }
};

}  // namespace

DeviceControl& device_control() {
  // Never destroyed: the interpreter-exit check may still use it while static destructors run.
  static auto* control = new NpuDeviceControl();
  return *control;
}

}  // namespace gemm_ar::npu
