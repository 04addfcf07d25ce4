// Run-time lookup of the HCCL entry points in hccl_internal_api.h. Their home library changed across CANN releases
// (libhccl, then libhcomm), and a CANN without them must still load this extension: the fused path then reports
// itself unavailable and `auto` falls back to `chunked`.
#pragma once
#include <string>

#include "npu/hccl_internal_api.h"

namespace gemm_ar::npu {

struct HcclInternalApi {
  decltype(&HcomGetL0TopoTypeEx) get_l0_topo_type = nullptr;
  decltype(&HcomGetCommHandleByGroup) get_comm_handle_by_group = nullptr;
  decltype(&HcclAllocComResourceByTiling) alloc_com_resource_by_tiling = nullptr;
  std::string missing;  // empty when all were found; otherwise which ones and where they were looked for
};

// Looked up once per process (thread-safe).
const HcclInternalApi& hccl_internal_api();

}  // namespace gemm_ar::npu
