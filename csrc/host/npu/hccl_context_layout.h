// Byte layouts HCCL shares with its callers but does not publish in the torch-npu wheel: the Mc2 tiling (v2) that
// HcclAllocComResourceByTiling reads, the device context it returns on MESH topologies, and the parts of its
// internal op-resource block that the RING (A3) path reads to find the peers' windows. Field order and widths follow
// CANN's HCCL sources (hicann/hcomm; asc-devkit impl/adv_api/tiling/hccl/hccl_tiling_msg.h) and pto-isa's gemm_ar
// seed; the names are kept so that they can be compared with those sources.
#pragma once
#include <cstddef>
#include <cstdint>

namespace gemm_ar::npu::hccl_layout {

constexpr uint32_t kMaxCcTilings = 8;
constexpr uint32_t kGroupNameBytes = 128;
constexpr uint32_t kAlgConfigBytes = 128;

// ---- Mc2 tiling, version 2: one init block followed by `mc2HcommCnt` communication blocks ----
struct Mc2InitTiling {
  uint32_t version;                // 100 = this layout
  uint32_t mc2HcommCnt;            // number of Mc2CcTiling blocks
  uint32_t offset[kMaxCcTilings];  // byte offset of each Mc2CcTiling from the start of this block
  uint8_t debugMode;
  uint8_t preparePosition;
  uint16_t queueNum;
  uint16_t commBlockNum;
  uint8_t devType;
  char reserved[17];
};

struct Mc2CcTiling {
  uint8_t skipLocalRankCopy;
  uint8_t skipBufferWindowCopy;
  uint8_t stepSize;
  uint8_t version;
  char reserved[9];
  uint8_t commEngine;
  uint8_t srcDataType;
  uint8_t dstDataType;
  char groupName[kGroupNameBytes];
  char algConfig[kAlgConfigBytes];
  uint32_t opType;
  uint32_t reduceType;
};

struct Mc2TilingV2 {
  Mc2InitTiling init;
  Mc2CcTiling cc;
};

// CANN's kernel_tiling.h reserves exactly these sizes for the two blocks (Mc2InitTiling / Mc2CcTiling).
static_assert(sizeof(Mc2InitTiling) == 64, "Mc2InitTiling must be 64 bytes");
static_assert(sizeof(Mc2CcTiling) == 280, "Mc2CcTiling must be 280 bytes");

// Values of the tiling this backend requests, those of pto-isa's gemm_ar example
// (docs/decisions/0013-npu-hccl-windows-and-setup.md).
constexpr uint32_t kInitTilingVersion = 100;
constexpr uint8_t kTilingDevType = 4;
constexpr uint8_t kCcTilingVersion = 1;
constexpr uint8_t kCommEngineAiv = 3;       // commEngine 3: the AI vector cores drive the transfers
constexpr uint32_t kOpTypeBatchWrite = 18;  // opType 18: one-sided writes into the peers' windows
constexpr const char* kAlgConfigFullMesh = "BatchWrite=level0:fullmesh";

// On MESH topologies HcclAllocComResourceByTiling returns a device context whose first fields are
// gemm_ar::CommContext (csrc/include/gemm_ar/kernel_args.hpp); on RING it returns the OpResParam below.

// ---- RING (A3): HCCL's op-resource block; the peers' windows hang off remoteRes[] ----
struct SignalInfo {
  uint64_t resId;
  uint64_t addr;
  uint32_t devId;
  uint32_t tsId;
  uint32_t rankId;
  uint32_t flag;
};

struct StreamInfo {
  int32_t streamIds;
  uint32_t sqIds;
  uint32_t cqIds;
  uint32_t logicCqids;
};

struct ListCommon {
  uint64_t nextHost;
  uint64_t preHost;
  uint64_t nextDevice;
  uint64_t preDevice;
};

constexpr uint32_t kLocalNotifyMax = 64;
constexpr uint32_t kLocalStreamMax = 19;
constexpr uint32_t kAicpuOpNotifyMax = 2;

struct LocalResInfoV2 {
  uint32_t streamNum;
  uint32_t signalNum;
  SignalInfo localSignals[kLocalNotifyMax];
  StreamInfo streamInfo[kLocalStreamMax];
  StreamInfo mainStreamInfo;
  SignalInfo aicpuOpNotify[kAicpuOpNotifyMax];
  ListCommon nextTagRes;
};

struct AlgoTopoInfo {
  uint32_t userRank;
  uint32_t userRankSize;
  int32_t deviceLogicId;
  bool isSingleMeshAggregation;
  uint32_t deviceNumPerAggregation;
  uint32_t superPodNum;
  uint32_t devicePhyId;
  uint32_t topoType;
  uint32_t deviceType;
  uint32_t serverNum;
  uint32_t meshAggregationRankSize;
  uint32_t multiModuleDiffDeviceNumMode;
  uint32_t multiSuperPodDiffServerNumMode;
  uint32_t realUserRank;
  bool isDiffDeviceModule;
  bool isDiffDeviceType;
  uint32_t gcdDeviceNumPerAggregation;
  uint32_t moduleNum;
  uint32_t isUsedRdmaRankPairNum;
  uint64_t isUsedRdmaRankPair;
  uint32_t pairLinkCounterNum;
  uint64_t pairLinkCounter;
  uint32_t nicNum;
  uint64_t nicList;
  uint64_t complanRankLength;
  uint64_t complanRank;
  uint64_t bridgeRankNum;
  uint64_t bridgeRank;
  uint64_t serverAndsuperPodRankLength;
  uint64_t serverAndsuperPodRank;
};

struct OpConfig {
  uint8_t deterministic;
  uint8_t retryEnable;
  uint8_t highPerfEnable;
  uint8_t padding[5];
  uint8_t linkTimeOut[8];
  uint64_t notifyWaitTime;
  uint32_t retryHoldTime;
  uint32_t retryIntervalTime;
  bool interXLinkDisable;
  uint32_t floatOverflowMode;  // an enum in HCCL: 4 bytes
  uint32_t multiQpThreshold;
};

struct RemoteResPtr {
  uint64_t nextHostPtr;
  uint64_t nextDevicePtr;  // device address of the peer's RankRelationResV2
};

struct Mc2Workspace {
  uint64_t workspace;
  uint64_t workspaceSize;
};

struct RankRelationResV2 {
  uint32_t remoteUsrRankId;
  uint32_t remoteWorldRank;
  uint64_t windowsIn;
  uint64_t windowsOut;
  uint64_t windowsExp;
  ListCommon nextTagRes;
};

// The leading fields of OpResParam after the workspace, read in one copy.
struct OpResParamHead {
  uint32_t localUsrRankId;
  uint32_t rankSize;
  uint64_t winSize;
  uint64_t localWindowsIn;
  uint64_t localWindowsOut;
  char hcomId[128];
  uint64_t winExpSize;
  uint64_t localWindowsExp;
};

struct OpResParam {
  Mc2Workspace mc2WorkSpace;
  uint32_t localUsrRankId;
  uint32_t rankSize;
  uint64_t winSize;
  uint64_t localWindowsIn;
  uint64_t localWindowsOut;
  char hcomId[128];
  uint64_t winExpSize;
  uint64_t localWindowsExp;
  uint32_t rWinStart;
  uint32_t rWinOffset;
  uint64_t version;
  LocalResInfoV2 localRes;
  AlgoTopoInfo topoInfo;
  OpConfig config;
  uint64_t hostStateInfo;
  uint64_t aicpuStateInfo;
  uint64_t lockAddr;
  uint32_t rsv[16];
  uint32_t notifysize;
  uint32_t remoteResNum;
  RemoteResPtr remoteRes[1];  // really rankSize entries, indexed by the peer's rank in the communicator
};

// The head copy must line up with the block it is read from.
static_assert(offsetof(OpResParam, localWindowsExp) - offsetof(OpResParam, localUsrRankId) ==
                  offsetof(OpResParamHead, localWindowsExp),
              "OpResParamHead must mirror OpResParam");

}  // namespace gemm_ar::npu::hccl_layout
