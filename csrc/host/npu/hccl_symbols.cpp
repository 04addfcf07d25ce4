#include "npu/hccl_symbols.h"

#include <dlfcn.h>

namespace gemm_ar::npu {
namespace {

// Libraries that have exported these functions, newest first. torch_npu has usually loaded one of them already;
// RTLD_DEFAULT only sees it when it was loaded with RTLD_GLOBAL, so the named libraries are opened as well.
constexpr const char* kCandidateLibraries[] = {"libhcomm.so", "libhccl.so"};

void* find_symbol(const char* name) {
  if (void* global = dlsym(RTLD_DEFAULT, name)) return global;
  for (const char* library : kCandidateLibraries) {
    // Never closed: the handle must outlive every call through the returned pointer.
    void* handle = dlopen(library, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) continue;
    if (void* symbol = dlsym(handle, name)) return symbol;
  }
  return nullptr;
}

template <typename Fn>
void resolve(Fn* slot, const char* name, std::string* missing) {
  *slot = reinterpret_cast<Fn>(find_symbol(name));
  if (*slot == nullptr) *missing += (missing->empty() ? "" : ", ") + std::string(name);
}

HcclInternalApi load() {
  HcclInternalApi api;
  resolve(&api.get_l0_topo_type, "HcomGetL0TopoTypeEx", &api.missing);
  resolve(&api.get_comm_handle_by_group, "HcomGetCommHandleByGroup", &api.missing);
  resolve(&api.alloc_com_resource_by_tiling, "HcclAllocComResourceByTiling", &api.missing);
  if (!api.missing.empty()) {
    api.missing += " (not exported by the loaded process, libhcomm.so or libhccl.so; CANN with MC2 support needed)";
  }
  return api;
}

}  // namespace

const HcclInternalApi& hccl_internal_api() {
  static const HcclInternalApi api = load();
  return api;
}

}  // namespace gemm_ar::npu
