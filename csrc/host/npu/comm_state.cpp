#include "npu/comm_state.h"

#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <sstream>
#include <stdexcept>
#include <vector>

#include <unistd.h>

#include "common/current_op.h"
#include "common/kernel_timeout.h"
#include "common/settings.h"
#include "npu/device_runtime.h"
#include "npu/hccl_context_layout.h"
#include "npu/ring_context.h"

namespace gemm_ar::npu {
namespace {

namespace layout = hccl_layout;

// How far one rank's setup got. The code travels to the other ranks so that every rank reaches the same decision
// and can say who failed where.
enum SetupStage : int64_t {
  kStageOk = 0,
  kStageSymbols = 1,
  kStageTopology = 2,
  kStageHandle = 3,
  kStageResources = 4,
  kStageContext = 5,
  kStageMismatch = 6,
  kStageCores = 7,
  kStageOther = 8,
  kStageAivExpansion = 9,
};

const char* stage_summary(int64_t stage) {
  switch (stage) {
    case kStageSymbols: return "HCCL one-sided API not found";
    case kStageTopology: return "HcomGetL0TopoTypeEx failed";
    case kStageHandle: return "HcomGetCommHandleByGroup failed";
    case kStageResources: return "HcclAllocComResourceByTiling failed";
    case kStageContext: return "reading the HCCL device context failed";
    case kStageMismatch: return "the HCCL device context does not cover the group (windows not reachable)";
    case kStageCores: return "AI core counts unavailable";
    case kStageAivExpansion:
      return "HCCL_OP_EXPANSION_MODE=AIV (HCCL's collectives take the vector cores the comm blocks need at once)";
    default: return "setup error";
  }
}

struct SetupError : std::runtime_error {
  SetupError(SetupStage stage, const std::string& message) : std::runtime_error(message), stage(stage) {}
  SetupStage stage;
};

// `status`: a runtime status code (ACL's on Ascend), 0 = success.
void check_acl(int32_t status, SetupStage stage, const char* what) {
  if (status != 0) {
    throw SetupError(stage, std::string(what) + " returned ACL error " + std::to_string(status));
  }
}

void copy_from_device(void* host, const void* device, size_t bytes, SetupStage stage, const char* what) {
  check_acl(device_control().copy_to_host_now(host, device, bytes), stage, what);
}

void read_device_for_setup(void* host, const void* device, size_t bytes, const char* what) {
  copy_from_device(host, device, bytes, kStageContext, what);
}

// RING topologies (A3): the context is assembled from HCCL's op-resource block (ring_context.cpp).
void assemble_ring_context(const uint8_t* block, CommContext* ctx) {
  try {
    gemm_ar::npu::assemble_ring_context(block, ctx, &read_device_for_setup);
  } catch (const RingContextError& e) {
    throw SetupError(e.mismatch ? kStageMismatch : kStageContext, e.what());
  }
}

// The runtime's AI Core op-execute timeout in ms (aclrtGetOpExecuteTimeout, only in newer CANN); without it, the
// documented default (common/kernel_timeout.h).
int64_t aicore_timeout_ms() {
  int64_t ms = 0;
  if (device_control().op_execute_timeout_ms(&ms) && ms > 0) return ms;
  return kAssumedAiCoreTimeoutMs;
}

int64_t device_info(int32_t device, DeviceAttribute attribute, const char* name) {
  int64_t value = 0;
  check_acl(device_control().device_info(device, attribute, &value), kStageCores, name);
  if (value <= 0) throw SetupError(kStageCores, std::string(name) + " reported " + std::to_string(value));
  return value;
}

// ACL_DEV_ATTR_CUBE_CORE_NUM is documented from CANN 8.5 on; before it, the AI Core count, which A2/A3 count in cube
// cores (docs/ascend.md, "Review findings, round 2").
int64_t cube_core_count(int32_t device) {
  int64_t value = 0;
  if (device_control().device_info(device, DeviceAttribute::kCubeCores, &value) == 0 && value > 0) return value;
  return device_info(device, DeviceAttribute::kAiCoreCores, "aclrtGetDeviceInfo(CUBE_CORE_NUM, then AICORE_CORE_NUM)");
}

// comm_block_num: the vector cores HCCL may prepare AIV resources for, the device's count (not a constant).
layout::Mc2TilingV2 batch_write_tiling(const std::string& hcom_name, int64_t comm_block_num) {
  layout::Mc2TilingV2 tiling;
  std::memset(&tiling, 0, sizeof(tiling));
  tiling.init.version = layout::kInitTilingVersion;
  tiling.init.mc2HcommCnt = 1;
  tiling.init.offset[0] = static_cast<uint32_t>(offsetof(layout::Mc2TilingV2, cc));
  tiling.init.commBlockNum = static_cast<uint16_t>(std::min<int64_t>(comm_block_num, UINT16_MAX));
  tiling.init.devType = layout::kTilingDevType;
  tiling.cc.version = layout::kCcTilingVersion;
  tiling.cc.commEngine = layout::kCommEngineAiv;
  tiling.cc.opType = layout::kOpTypeBatchWrite;
  std::strncpy(tiling.cc.groupName, hcom_name.c_str(), sizeof(tiling.cc.groupName) - 1);
  std::strncpy(tiling.cc.algConfig, layout::kAlgConfigFullMesh, sizeof(tiling.cc.algConfig) - 1);
  return tiling;
}

// What one rank contributes to the agreement.
struct LocalSetup {
  int64_t stage = kStageOk;
  std::string error;
  int64_t window_bytes = 0, compute_blocks = 0, comm_blocks = 0;
};

// Everything up to (not including) the cross-rank agreement. Never throws: a failure is reported, so that this
// rank still joins the agreement and no peer waits for it forever.
LocalSetup set_up_locally(CommState& state, c10d::ProcessGroup& group) {
  DeviceControl& control = device_control();
  LocalSetup local;
  try {
    // In AIV expansion mode HCCL's collectives are vector kernels that take every vector core and wait for their
    // own blocks; beside them the comm blocks, which wait for the peers' blocks, may not all be resident
    // (docs/ascend.md, "Co-residency").
    const char* expansion = std::getenv("HCCL_OP_EXPANSION_MODE");
    if (expansion != nullptr && std::string(expansion) == "AIV") {
      throw SetupError(kStageAivExpansion,
                       "HCCL_OP_EXPANSION_MODE=AIV is set: unset it (or use another mode) on "
                       "every rank to run `fused`");
    }
    state.hcom_name = control.hccl_comm_name(group, state.device.index());
    const std::string missing = control.hccl_one_sided_missing();
    if (!missing.empty()) throw SetupError(kStageSymbols, "missing " + missing);

    // Results are HCCL status codes, 0 = HCCL_SUCCESS.
    int32_t result = control.hccl_topology_is_mesh(state.hcom_name, &state.mesh);
    if (result != 0) {
      throw SetupError(kStageTopology, "HcomGetL0TopoTypeEx('" + state.hcom_name + "') returned HCCL error " +
                                           std::to_string(static_cast<int>(result)));
    }
    result = control.hccl_comm_handle(state.hcom_name, &state.comm);
    if (result != 0 || state.comm == nullptr) {
      throw SetupError(kStageHandle, "HcomGetCommHandleByGroup('" + state.hcom_name + "') returned HCCL error " +
                                         std::to_string(static_cast<int>(result)));
    }

    // HCCL may keep using the stream it was given for the resources' lifetime, so it gets its own and keeps it.
    NativeStream resource_stream = nullptr;
    check_acl(control.create_stream(&resource_stream), kStageResources, "aclrtCreateStream");
    const int32_t device = state.device.index();
    const int64_t cube = cube_core_count(device);
    const int64_t vector = device_info(device, DeviceAttribute::kVectorCores, "aclrtGetDeviceInfo(VECTOR_CORE_NUM)");
    layout::Mc2TilingV2 tiling = batch_write_tiling(state.hcom_name, vector);
    void* context = nullptr;
    result = control.hccl_alloc_comm_resource(state.comm, resource_stream, &tiling, &context);
    if (result != 0 || context == nullptr) {
      throw SetupError(kStageResources, "HcclAllocComResourceByTiling('" + state.hcom_name +
                                            "', BatchWrite full mesh) returned HCCL error " +
                                            std::to_string(static_cast<int>(result)));
    }
    check_acl(control.synchronize_stream(resource_stream), kStageResources, "aclrtSynchronizeStream");
    check_acl(control.create_stream(&state.comm_stream), kStageResources, "aclrtCreateStream(comm)");

    if (state.mesh) {
      // MESH: HCCL's context starts with exactly the fields the kernels read.
      copy_from_device(&state.host_ctx, context, sizeof(state.host_ctx), kStageContext, "aclrtMemcpy(context)");
      state.comm_ctx_device = reinterpret_cast<uint64_t>(context);
    } else {
      assemble_ring_context(static_cast<const uint8_t*>(context), &state.host_ctx);
      state.assembled_ctx =
          control.to_device_now(at::from_blob(&state.host_ctx, {static_cast<int64_t>(sizeof(CommContext))}, at::kByte),
                                state.device);
      state.comm_ctx_device = reinterpret_cast<uint64_t>(state.assembled_ctx.data_ptr());
    }

    const CommContext& ctx = state.host_ctx;
    if (static_cast<int>(ctx.rank_num) != state.world || static_cast<int>(ctx.rank_id) != state.rank) {
      throw SetupError(kStageMismatch, "HCCL's context describes rank " + std::to_string(ctx.rank_id) + " of " +
                                           std::to_string(ctx.rank_num) + ", the group has this rank as " +
                                           std::to_string(state.rank) + " of " + std::to_string(state.world));
    }
    for (int peer = 0; peer < state.world; ++peer) {
      if (ctx.windows_in[peer] == 0) {
        throw SetupError(kStageMismatch, "no window address for rank " + std::to_string(peer) +
                                             " (groups that span several servers are not supported by `fused`)");
      }
    }
    local.window_bytes = static_cast<int64_t>(ctx.win_size);

    // One compute block per cube core. Every comm block must be resident at once (they wait for the peers' blocks):
    // at most half the vector cores, so that a second group's fused call, or other vector work, fits beside them
    // (docs/ascend.md, "Co-residency").
    const int64_t max_compute = std::min(cube, kMaxComputeBlocks);
    const int64_t max_comm = std::clamp<int64_t>(vector / 2, 1, kMaxCommBlocks);
    local.compute_blocks = env_int(Setting::kNpuComputeBlocks, max_compute, 1, max_compute);
    local.comm_blocks = env_int(Setting::kNpuCommBlocks, max_comm, 1, max_comm);
  } catch (const SetupError& e) {
    local.stage = e.stage;
    local.error = e.what();
  } catch (const std::exception& e) {
    local.stage = kStageOther;
    local.error = e.what();
  }
  return local;
}

// Agreement fields: one row per rank, filled only by its owner, so that a SUM all-reduce gathers them.
enum AgreementField : int64_t {
  kFieldStage,
  kFieldWindow,
  kFieldCompute,
  kFieldComm,
  kFieldEpoch,
  kFieldHost,
  kFields,
};

// FNV-1a of the host name: equal on ranks of one server, which `fused` requires (the ranks agree on it at setup:
// docs/decisions/0013-npu-hccl-windows-and-setup.md).
int64_t host_fingerprint() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return 0;
  uint64_t hash = 14695981039346656037ull;
  for (const char* c = name; *c != '\0'; ++c) hash = (hash ^ static_cast<unsigned char>(*c)) * 1099511628211ull;
  return static_cast<int64_t>(hash >> 1);  // non-negative, so the SUM gather cannot overflow into it
}

void agree(CommState& state, c10d::ProcessGroup& group, const LocalSetup& local) {
  auto table = at::zeros({state.world, kFields}, at::TensorOptions().dtype(at::kLong));
  auto row = table[state.rank];
  row[kFieldStage] = local.stage;
  row[kFieldWindow] = local.window_bytes;
  row[kFieldCompute] = local.compute_blocks;
  row[kFieldComm] = local.comm_blocks;
  row[kFieldHost] = host_fingerprint();
  if (state.rank == 0) {
    // A random first epoch: flags a previous process left in recycled window memory never carry this run's tags.
    row[kFieldEpoch] = static_cast<int64_t>(std::random_device{}());
  }
  std::vector<at::Tensor> tensors{device_control().to_device_now(table, state.device)};
  c10d::AllreduceOptions options;
  options.timeout = wait_timeout();
  group.allreduce(tensors, options)->wait(options.timeout);
  auto gathered = device_control().to_host_now(tensors[0]);
  auto rows = gathered.accessor<int64_t, 2>();

  std::ostringstream failures;
  bool only_symbols = true, any_topology = false;
  int64_t window = INT64_MAX, compute = INT64_MAX, comm = INT64_MAX;
  for (int r = 0; r < state.world; ++r) {
    const int64_t stage = rows[r][kFieldStage];
    if (stage != kStageOk) {
      failures << (failures.tellp() ? "; " : "") << "rank " << r << ": " << stage_summary(stage);
      only_symbols = only_symbols && stage == kStageSymbols;
      any_topology = any_topology || stage == kStageMismatch || stage == kStageTopology;
      continue;
    }
    window = std::min(window, rows[r][kFieldWindow]);
    compute = std::min(compute, rows[r][kFieldCompute]);
    comm = std::min(comm, rows[r][kFieldComm]);
  }
  for (int r = 1; r < state.world; ++r) {
    if (rows[r][kFieldHost] != rows[0][kFieldHost]) {
      state.unavailable = "group '" + state.group_name + "' spans several hosts (rank " + std::to_string(r) +
                          " is not on rank 0's); the fused NPU path needs every rank on one server";
      state.unavailable_kind = FusedBlocker::kTopology;
      return;
    }
  }
  if (failures.tellp()) {
    state.unavailable = "HCCL one-sided window setup failed (" + failures.str() + ")" +
                        (local.error.empty() ? std::string() : "; on this rank: " + local.error);
    state.unavailable_kind = only_symbols   ? FusedBlocker::kSymbols
                             : any_topology ? FusedBlocker::kTopology
                                            : FusedBlocker::kSetup;
    return;
  }
  state.window_bytes = static_cast<uint64_t>(window);
  state.compute_blocks = static_cast<int32_t>(compute);
  state.comm_blocks = static_cast<int32_t>(comm);
  state.calls = KernelErrorWatch(static_cast<uint32_t>(rows[0][kFieldEpoch]));
  state.epoch_device = device_control().to_device_now(
      at::full({1}, static_cast<int64_t>(static_cast<uint32_t>(rows[0][kFieldEpoch])), at::kLong), state.device);
  state.aicore_timeout_ms = aicore_timeout_ms();
  DeviceQueue& queue = device_queue();
  state.error_device = queue.empty({static_cast<int64_t>(sizeof(ErrorRecord))},
                                   at::TensorOptions().dtype(at::kByte).device(state.device));
  queue.fill_zero(queue.current_stream(state.device.index()), state.error_device);
  state.error_host = queue.empty_pinned(static_cast<int64_t>(sizeof(ErrorRecord)));
  std::memset(state.error_host.data_ptr(), 0, sizeof(ErrorRecord));
}

void set_up(CommState& state, c10d::ProcessGroup& group) {
  std::string backend_name;
  if (!device_control().has_hccl_backend(group, &backend_name)) {
    // Same answer on every rank (it is a property of the group), so no agreement is needed.
    state.unavailable = "group '" + state.group_name + "' has no HCCL backend for NPU tensors" +
                        (backend_name.empty() ? std::string() : " (its NPU backend is " + backend_name + ")");
    state.unavailable_kind = FusedBlocker::kBackend;
    return;
  }
  c10::DeviceGuard guard(state.device);
  LocalSetup local = set_up_locally(state, group);
  agree(state, group, local);
}

// Held across the setup collective, so two threads never set up the same group twice. Never destroyed: device
// memory and HCCL resources must not be released by static destructors after torch_npu has shut down.
std::mutex& registry_mutex() {
  static auto* mutex = new std::mutex();
  return *mutex;
}
std::map<std::string, std::unique_ptr<CommState>>& registry() {
  static auto* states = new std::map<std::string, std::unique_ptr<CommState>>();
  return *states;
}

}  // namespace

std::vector<CommState*> all_comm_states() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<CommState*> out;
  for (auto& entry : registry()) out.push_back(entry.second.get());
  return out;
}

CommState& comm_state(c10d::ProcessGroup& group, const at::Device& device) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto* registry = &gemm_ar::npu::registry();
  const std::string key = group.getGroupName() + "@" + std::to_string(device.index());
  auto found = registry->find(key);
  if (found != registry->end()) return *found->second;
  // A second device would set the group up again, a collective its peers are not in: refused (HCCL binds a
  // process group to one device per rank).
  for (const auto& [other_key, other] : *registry) {
    TORCH_CHECK_VALUE(other->group_name != group.getGroupName(), current_op(), ": group '", group.getGroupName(),
                      "' runs its fused calls on ", other->device.str(), " on this rank; got tensors on ", device.str(),
                      " (use one device per rank and group, as HCCL does)");
  }
  auto state = std::make_unique<CommState>();
  state->group_name = group.getGroupName();
  state->rank = group.getRank();
  state->world = group.getSize();
  state->device = device;
  set_up(*state, group);
  return *registry->emplace(key, std::move(state)).first->second;
}

}  // namespace gemm_ar::npu
