// HCCL entry points that the torch-npu wheel's headers (hccl/hccl.h, hccl/hccl_types.h) do not declare, with their
// exact signatures as CANN's HCCL declares them:
//   HcomGetL0TopoTypeEx, HcomGetCommHandleByGroup: hicann/hcomm, pkg_inc/legacy/hccl/hcom.h
//   HcclAllocComResourceByTiling:                   hicann/hcomm, pkg_inc/legacy/hccl/hccl_ex.h
//   CommTopo:                                       hicann/hcomm, include/hccl/hccl_rank_graph.h
// All three are C functions exported by libhccl (older CANN) or libhcomm (CANN 8.5+). They are looked up at run time
// (hccl_symbols.cpp) rather than linked, so that a CANN without them still loads the extension and the op falls back
// to `chunked` with a warning instead of failing to import.
#pragma once
#include <hccl/hccl_types.h>

#include <cstdint>

#ifndef HCCL_RANK_GRAPH_H
// Same enumerators and values as hccl_rank_graph.h; only defined here when that header is not in the build.
typedef enum {
  COMM_TOPO_RESERVED = -1,
  COMM_TOPO_CLOS = 0,
  COMM_TOPO_1DMESH = 1,  // "MESH": A2 servers (HCCS full mesh)
  COMM_TOPO_910_93 = 2,
  COMM_TOPO_310P = 3,
  COMM_TOPO_A2AXSERVER = 4,
  COMM_TOPO_CUSTOM = 5
} CommTopo;
#endif

extern "C" {
HcclResult HcomGetL0TopoTypeEx(const char* group, CommTopo* topoType, uint32_t flag);
HcclResult HcomGetCommHandleByGroup(const char* group, HcclComm* commHandle);
HcclResult HcclAllocComResourceByTiling(HcclComm comm, void* stream, void* Mc2Tiling, void** commContext);
}

namespace gemm_ar::npu {

// `flag` of HcomGetL0TopoTypeEx: 0 = do not bind the calling thread to the device (it already is).
constexpr uint32_t kTopoQueryWithoutSetDevice = 0;

}  // namespace gemm_ar::npu
