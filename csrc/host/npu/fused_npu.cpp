#include "npu/fused_npu.h"

#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "common/current_op.h"
#include "common/kernel_timeout.h"
#include "common/rank_agreement.h"
#include "common/settings.h"
#include "gemm_ar/kernel_args.hpp"
#include "gemm_ar/sequence_parallel.hpp"
#include "npu/device_runtime.h"
#include "npu/fused_call_sequence.h"
#include "npu/sync_points.h"

namespace gemm_ar::npu {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
// The kernels' DMA takes 16-bit row strides (in elements) on A2/A3.
constexpr int64_t kMaxRowStride = 65535;
// The kernels compare the fields every rank must agree on; the carried-only ones (auto tuning times) stay zero.
static_assert(kSigComparedFields <= kSignatureWords, "the kernels compare kSignatureWords words of the signature");

uint32_t dtype_code(at::ScalarType dtype) {
  if (dtype == at::kHalf) return kDTypeFloat16;
  if (dtype == at::kBFloat16) return kDTypeBFloat16;
  return 0;
}

// The row stride the kernels should use for a [rows, cols] view with unit column stride; any value >= cols is
// fine for a single row, whose stride torch leaves arbitrary.
int64_t row_stride(const at::Tensor& t, int64_t rows, int64_t cols) {
  return rows <= 1 ? std::max<int64_t>(cols, 1) : t.stride(0);
}

// The operands as the kernels read them: unit stride along the fast dimension, b either [K, N] row-major or the
// transpose of a row-major [N, K] (nn.Linear's weight.t(), passed without a copy).
struct Operands {
  at::Tensor a, b, bias;
  int64_t lda = 0, ldb = 0;
  uint32_t b_layout = kBRowMajor;
};

// Copies and zeroing are queued on `stream`, the caller's.
Operands prepare_operands(const CallArgs& call, const TilePlan& plan, const c10::Stream& stream) {
  DeviceQueue& queue = device_queue();
  const int64_t m = call.m, k = call.k, n = call.n;
  Operands ops;
  ops.a = call.a2d;
  const bool a_usable = (k == 1 || ops.a.stride(1) == 1) && (m == 1 || ops.a.stride(0) >= k);
  if (!a_usable || row_stride(ops.a, m, k) > kMaxRowStride) ops.a = queue.contiguous(stream, ops.a);
  ops.lda = ops.a.is_contiguous() ? k : row_stride(ops.a, m, k);

  const at::Tensor& b = call.b;
  if ((n == 1 || b.stride(1) == 1) && (k == 1 || b.stride(0) >= n) && (k == 1 || b.stride(0) <= kMaxRowStride)) {
    ops.b = b;
    ops.b_layout = kBRowMajor;
    ops.ldb = k == 1 ? n : b.stride(0);
  } else if ((k == 1 || b.stride(0) == 1) && (n == 1 || (b.stride(1) >= k && b.stride(1) <= kMaxRowStride))) {
    ops.b = b;
    ops.b_layout = kBTransposed;
    ops.ldb = n == 1 ? k : b.stride(1);
  } else {
    ops.b = queue.contiguous(stream, b);
    ops.b_layout = kBRowMajor;
    ops.ldb = n;
  }
  // The cube adds the bias to its fp32 accumulator (A2/A3's bias table takes fp32) and loads it in whole 32-byte
  // blocks per tile, so it goes in as fp32 padded with zeros to pad_n.
  if (call.bias.has_value()) {
    ops.bias = queue.empty({plan.pad_n}, call.bias->options().dtype(at::kFloat));
    queue.fill_zero(stream, ops.bias);
    // Same device (checked with the other arguments): a stream-ordered copy.
    queue.copy_async(stream, ops.bias.narrow(0, 0, n), *call.bias);
  }
  return ops;
}

// The sequence-parallel kernel pair a call runs (gemm_ar/sequence_parallel.hpp), 0 for gemm_allreduce's.
uint32_t sp_op_of(const CallArgs& call) {
  if (call.op == kOpGemmReduceScatter) return kOpGemmReduceScatter;
  if (call.op == kOpAllgatherGemm) return kOpAllgatherGemm;
  return 0;
}

}  // namespace

// Decode while the partial product a rank pushes to every peer is at most this many bytes: above it one HCCS link
// carries more than the tiled kernels (or HCCL's all_reduce) put on it by more than the latency the decode path
// saves (the estimate in docs/ascend.md, "Decode"; not measured on hardware).
constexpr int64_t kDecodeMaxPartialBytes = 512 * 1024;

uint32_t fused_variant(const CallArgs& call) {
  // gemm_allreduce_add_rmsnorm runs gemm_allreduce's pair (with the epilogue), so it has the decode variant too.
  const bool allreduce_pair = call.op == kOpGemmAllreduce || call.op == kOpGemmAllreduceAddRmsnorm;
  if (!allreduce_pair || !decode_plannable(call.m, call.n)) return kVariantTiled;
  // M <= 64 and N <= 65536 here: no overflow.
  const int64_t partial_bytes = call.m * call.n * static_cast<int64_t>(c10::elementSize(call.dtype));
  return partial_bytes <= kDecodeMaxPartialBytes ? kVariantDecode : kVariantTiled;
}

namespace {

// Arguments that depend only on the call's sizes and the communicator: what check_fused and run_fused share.
bool plan_call(const CallArgs& call, const CommState& state, KernelArgs* args) {
  *args = KernelArgs{};
  args->magic = kKernelArgsMagic;
  args->dtype = dtype_code(call.dtype);
  args->rank = state.rank;
  args->world = state.world;
  args->compute_blocks = state.compute_blocks;
  args->comm_blocks = state.comm_blocks;
  const uint32_t sp_op = sp_op_of(call);
  if (sp_op == 0) {
    return fused_variant(call) == kVariantDecode ? plan_decode_kernel_args(args, call.m, call.n, call.k)
                                                 : plan_kernel_args(args, call.m, call.n, call.k);
  }
  // One row chunk per rank: a reduce-scatter's is the rank's rows of the output, an allgather's its shard (its a).
  const int64_t m_sub = sp_op == kOpGemmReduceScatter ? call.m / state.world : call.m;
  return plan_sp_kernel_args(args, sp_op, m_sub, call.n, call.k);
}

std::string window_too_small(const CallArgs& call, const CommState& state, const KernelArgs& args, uint64_t needed) {
  const int64_t needed_mib = (static_cast<int64_t>(needed) + kMiB - 1) / kMiB;
  std::ostringstream os;
  os << "the HCCL window of group '" << state.group_name << "' holds " << state.window_bytes / kMiB
     << " MiB but this call needs " << needed_mib << " MiB (M=" << call.m << ", N=" << call.n << " padded to "
     << args.plan.pad_m << "x" << args.plan.pad_n << ": " << args.layout.reduced_bytes
     << (args.variant == kVariantDecode ? " B of partials (one per rank) + signals + "
                                        : " B reduced buffer + signals + ")
     << kHcclStagingReserveBytes / kMiB << " MiB left to HCCL); set HCCL_BUFFSIZE=" << needed_mib
     << " (MB; HCCL's default is 200) on every rank before the process group is created";
  return os.str();
}

void keep_alive_on(const c10::Stream& stream, std::initializer_list<at::Tensor> tensors) {
  for (const at::Tensor& t : tensors) device_queue().keep_alive(stream, t);
}

// Nothing the per-call path does may wait for the device or copy from it synchronously: a stream being captured
// into an NPU graph must see only launches and asynchronous copies.
bool capturing() { return device_queue().capturing(); }

// The signature the kernels compare: the host's CallSignature plus the fused configuration (block counts and
// tiles), so that ranks built or configured differently stop instead of mixing layouts.
CallSignature fused_signature(const CallArgs& call, Algorithm chosen, const CommState& state) {
  CallSignature sig = call_signature(call, chosen);
  if (chosen == Algorithm::Fused) {
    sig[kSigTileM] = kNpuBaseM;
    sig[kSigTileN] = kNpuBaseN;
    sig[kSigSubM] = kNpuSubM;
    sig[kSigComputeBlocks] = state.compute_blocks;
    sig[kSigCommBlocks] = state.comm_blocks;
    sig[kSigEngineMode] = fused_variant(call);  // how the call uses the windows (KernelArgs::variant)
  }
  return sig;
}

// What every launch of a call needs, shape or not: who, where, which call, how long to wait.
void fill_call_header(KernelArgs* args, const CommState& state, uint32_t epoch, const CallSignature& signature) {
  args->magic = kKernelArgsMagic;
  args->rank = state.rank;
  args->world = state.world;
  args->compute_blocks = state.compute_blocks;
  args->comm_blocks = state.comm_blocks;
  args->epoch = epoch;
  args->comm_ctx = state.comm_ctx_device;
  args->window_offset = kHcclStagingReserveBytes;
  args->window_bytes = state.window_bytes - kHcclStagingReserveBytes;
  args->error = reinterpret_cast<uint64_t>(state.error_device.data_ptr());
  args->epoch_counter = reinterpret_cast<uint64_t>(state.epoch_device.data_ptr());
  const KernelWaitBound bound = kernel_wait_bound(wait_timeout().count(), state.aicore_timeout_ms);
  if (bound.capped) {
    static std::once_flag warned;
    std::call_once(warned, [&] {
      TORCH_WARN("gemm_allreduce (fused, NPU): TORCH_GEMM_AR_TIMEOUT_S=", wait_timeout().count() / 1000,
                 " s is above the AI Core kernel execution timeout of ", state.aicore_timeout_ms / 1000,
                 " s (aclrtGetOpExecuteTimeout), after which the runtime kills the kernels and their error record "
                 "is lost; the kernels wait at most ",
                 bound.wait_ms / 1000, " s instead");
    });
  }
  args->wait_timeout_us = static_cast<uint32_t>(std::min<int64_t>(bound.wait_ms * 1000, UINT32_MAX));
  for (int64_t w = 0; w < kSignatureWords; ++w) args->signature[w] = w < kSigComparedFields ? signature[w] : 0;
}

// The kernels take the struct through device memory; a pinned staging copy (caching host allocator) keeps the
// upload asynchronous. A captured graph replays the copy from the same host address, so while capturing the
// staging buffer is kept for good instead of going back to the pool (a few hundred bytes per captured call).
at::Tensor upload_args(const KernelArgs& args, const at::Device& device, CommState& state, const c10::Stream& stream) {
  DeviceQueue& queue = device_queue();
  auto args_host = queue.empty_pinned(static_cast<int64_t>(sizeof(KernelArgs)));
  std::memcpy(args_host.data_ptr(), &args, sizeof(args));
  if (capturing()) state.captured_args.push_back(args_host);
  auto args_device =
      queue.empty({static_cast<int64_t>(sizeof(KernelArgs))}, at::TensorOptions().dtype(at::kByte).device(device));
  queue.copy_async(stream, args_device, args_host);
  return args_device;
}

// The device queue's streams and events as the runtime of queue_fused_call (npu/fused_call_sequence.h).
class GroupStreamRuntime {
 public:
  using Stream = c10::Stream;
  using Event = DeviceEvent;

  explicit GroupStreamRuntime(CommState& state) : state_(state), queue_(device_queue()) {}

  Event record(const Stream& stream) { return queue_.record(stream); }
  void stream_waits_for(const Stream& stream, const Event& event) { queue_.stream_waits_for(stream, event); }
  void add_epoch(const Stream& stream) { queue_.increment_counter(stream, state_.epoch_device); }
  bool capturing(const Stream&) { return npu::capturing(); }
  // An asynchronous copy into pinned memory and an event the next call queries.
  void refresh_error_copy(const Stream& stream) {
    queue_.copy_async(stream, state_.error_host, state_.error_device);
    state_.error_copied = record(stream);
  }
  // Not while capturing (an event query is not allowed then; check_errors() reports).
  std::string take_landed_failure() {
    if (!state_.error_copied || !queue_.query(state_.error_copied)) return "";
    ErrorRecord record;
    std::memcpy(&record, state_.error_host.data_ptr(), sizeof(record));
    return state_.calls.take_unreported(record, state_.group_name, &signature_field_name, &error_code_summary);
  }

 private:
  CommState& state_;
  DeviceQueue& queue_;
};

// Queues one call's kernels (launch(caller, comm)) in the group's order and raises an earlier call's failure after
// it was queued (npu/fused_call_sequence.h). Needs state.mutex.
template <class Launch>
void queue_in_group_order(CommState& state, const c10::Stream& caller, const Launch& launch) {
  const c10::Stream comm = device_queue().native_stream(state.comm_stream, caller.device_index());
  TORCH_CHECK(comm != caller, current_op(),
              ": the current stream is the group's comm stream; fused calls cannot "
              "be queued from it");
  GroupStreamRuntime runtime(state);
  const std::string earlier = queue_fused_call(runtime, state.order, caller, comm, launch);
  TORCH_CHECK(earlier.empty(), earlier);
}

// The device whose group state a call uses, the same in check_fused, agree_fused and the launch: the call's
// tensors' device where the call has them, else the current device (a call whose arguments were rejected).
at::Device call_device(const CallArgs& call) {
  if (call.b.defined() && call.b.device().type() == c10::DeviceType::PrivateUse1) return call.b.device();
  return at::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device_queue().current_device()));
}

}  // namespace

FusedCheck check_fused(const CallArgs& call, c10d::ProcessGroup& group) {
  if (group.getSize() > kMaxWorld) {
    return {FusedBlocker::kWorld, "the fused NPU kernels handle at most " + std::to_string(kMaxWorld) + " ranks"};
  }
  // Set up before anything that depends on this rank's arguments: the setup is collective and every rank asks
  // this question on every call, bad arguments or not (op_flow), so all ranks meet in it on the group's first call.
  CommState& state = comm_state(group, call_device(call));
  if (!call.error.empty()) return {FusedBlocker::kShape, call.error};  // raised by the agreement that follows
  if (dtype_code(call.dtype) == 0) {
    return {FusedBlocker::kDtype,
            std::string("the fused NPU kernels take float16 and bfloat16, not ") + c10::toString(call.dtype)};
  }
  if (!state.unavailable.empty()) return {state.unavailable_kind, state.unavailable};
  if (call.m == 0) return {};  // the op returns an empty tensor without running anything
  if (sp_op_of(call) != 0 && call.shard_dim != 0) {
    return {FusedBlocker::kShape, "the fused NPU kernels of " + call.op_name + " shard dim 0 only, not dim " +
                                      std::to_string(call.shard_dim)};
  }
  if (call.k == 0 || call.n == 0) {
    return {FusedBlocker::kShape, "K=" + std::to_string(call.k) + ", N=" + std::to_string(call.n) +
                                      ": an empty product has nothing to overlap"};
  }
  if (call.k > kMaxRowStride || call.n > kMaxRowStride) {
    return {FusedBlocker::kShape, "K=" + std::to_string(call.k) + ", N=" + std::to_string(call.n) +
                                      ": the fused NPU kernels take row strides up to " +
                                      std::to_string(kMaxRowStride) + " elements"};
  }
  KernelArgs args;
  if (!plan_call(call, state, &args)) {
    return {FusedBlocker::kShape, "the fused NPU kernels cannot plan M=" + std::to_string(call.m) +
                                      ", N=" + std::to_string(call.n) + ", K=" + std::to_string(call.k)};
  }
  const uint64_t needed = kHcclStagingReserveBytes + static_cast<uint64_t>(args.layout.window_bytes);
  if (needed > state.window_bytes) return {FusedBlocker::kWindow, window_too_small(call, state, args, needed)};
  return {};
}

namespace {

// The kernel pair of one op.
struct KernelPair {
  Kernel compute;
  Kernel comm;
};
constexpr KernelPair kAllreducePair{Kernel::kGemmCompute, Kernel::kGemmComm};
constexpr KernelPair kReduceScatterPair{Kernel::kRsCompute, Kernel::kRsComm};
constexpr KernelPair kAllgatherPair{Kernel::kAgCompute, Kernel::kAgComm};

// Plans, uploads and launches one fused call of `pair` writing `out` (the op's [rows, N], contiguous, on b's
// device), and returns the call's scratch (the allgather's gathered a lives at its start). check_fused must have
// passed. `epilogue`: gemm_allreduce's add+RMSNorm operands, or none (every other call, the sequence-parallel ones
// included: their kernels refuse an epilogue).
at::Tensor launch_fused(const CallArgs& call, c10d::ProcessGroup& group, const KernelPair& pair, const at::Tensor& out,
                        const AddRmsNormOperands* epilogue = nullptr) {
  const at::Device device = call_device(call);
  c10::DeviceGuard device_guard(device);
  CommState& state = comm_state(group, device);
  TORCH_CHECK(state.unavailable.empty(), call.op_name, ": fused NPU path unavailable: ", state.unavailable);
  std::lock_guard<std::mutex> lock(state.mutex);

  KernelArgs args;
  TORCH_CHECK(plan_call(call, state, &args), call.op_name, ": the fused NPU kernels cannot plan M=", call.m,
              ", N=", call.n, ", K=", call.k);
  const uint64_t needed = kHcclStagingReserveBytes + static_cast<uint64_t>(args.layout.window_bytes);
  TORCH_CHECK(needed <= state.window_bytes, call.op_name, ": ", window_too_small(call, state, args, needed));

  DeviceQueue& queue = device_queue();
  const c10::Stream caller = queue.current_stream(device.index());
  const Operands ops = prepare_operands(call, args.plan, caller);
  const auto bytes = at::TensorOptions().dtype(at::kByte).device(device);
  // The kernels want the scratch kWindowAlign-aligned; the slack makes that true whatever the allocator returns.
  auto scratch_storage = queue.empty({args.layout.scratch_bytes + kWindowAlign}, bytes);
  const auto storage_address = static_cast<int64_t>(reinterpret_cast<uintptr_t>(scratch_storage.data_ptr()));
  const int64_t skip = align_up(storage_address, kWindowAlign) - storage_address;
  auto scratch = scratch_storage.narrow(0, skip, args.layout.scratch_bytes);
  // Queue slots carry epoch tags; zero is never one, so recycled memory can never look like a published tile.
  queue.fill_zero(caller, scratch.narrow(0, args.layout.queue_offset,
                                         static_cast<int64_t>(state.compute_blocks) * args.layout.queue_stride));

  fill_call_header(&args, state, state.calls.take_epoch(), fused_signature(call, Algorithm::Fused, state));
  args.b_layout = ops.b_layout;
  args.a = reinterpret_cast<uint64_t>(ops.a.data_ptr());
  args.b = reinterpret_cast<uint64_t>(ops.b.data_ptr());
  args.bias = ops.bias.defined() ? reinterpret_cast<uint64_t>(ops.bias.data_ptr()) : 0;
  args.out = reinterpret_cast<uint64_t>(out.data_ptr());
  args.lda = ops.lda;
  args.ldb = ops.ldb;
  args.ldo = call.n;
  args.scratch = reinterpret_cast<uint64_t>(scratch.data_ptr());
  args.bias_rank = 0;
  if (epilogue != nullptr) {
    // Contiguous [M, N] / [N] tensors on the call's device (run_gemm_allreduce_add_rmsnorm_on_device prepared them).
    args.epilogue.kind = kEpilogueAddRmsNorm;
    args.epilogue.eps = static_cast<float>(epilogue->eps);
    args.epilogue.residual = reinterpret_cast<uint64_t>(epilogue->residual2d.data_ptr());
    args.epilogue.norm_weight = reinterpret_cast<uint64_t>(epilogue->weight.data_ptr());
    args.epilogue.normed = reinterpret_cast<uint64_t>(epilogue->normed2d.data_ptr());
    args.epilogue.ld_residual = call.n;
    args.epilogue.ld_normed = call.n;
  }

  at::Tensor args_device = upload_args(args, device, state, caller);
  void* args_ptr = args_device.data_ptr();

  queue_in_group_order(state, caller, [&](const c10::Stream& compute_stream, const c10::Stream& comm_stream) {
    queue.launch(compute_stream, pair.compute, static_cast<uint32_t>(state.compute_blocks), args_ptr);
    queue.launch(comm_stream, pair.comm, static_cast<uint32_t>(state.comm_blocks), args_ptr);
    keep_alive_on(comm_stream, {args_device, scratch, out});
    if (epilogue != nullptr) keep_alive_on(comm_stream, {epilogue->residual2d, epilogue->weight, epilogue->normed2d});
  });
  // Opt-in: wait for this call's kernels and raise its own failure (a synchronisation, in sync_points.cpp), which a
  // stream being captured cannot do: raised after queuing, as every rank queued the call.
  if (env_int(Setting::kNpuSyncErrors, 0, 0, 1) == 1) {
    TORCH_CHECK(!capturing(), call.op_name,
                ": TORCH_GEMM_AR_NPU_SYNC_ERRORS=1 waits for every call, which a stream "
                "being captured into a graph cannot; unset it while capturing (check_errors() reports after replays)");
    wait_and_raise_errors(state);
  }
  return scratch;
}

// gemm_allreduce's pair, with or without the add+RMSNorm epilogue.
at::Tensor run_allreduce_pair(const CallArgs& call, c10d::ProcessGroup& group, const AddRmsNormOperands* epilogue) {
  auto out = device_queue().empty({call.m, call.n}, call.b.options());
  launch_fused(call, group, kAllreducePair, out, epilogue);
  return out.view(call.out_shape);
}

}  // namespace

at::Tensor run_fused(const CallArgs& call, c10d::ProcessGroup& group) {
  return run_allreduce_pair(call, group, nullptr);
}

at::Tensor run_fused_add_rmsnorm(const CallArgs& call, c10d::ProcessGroup& group, const AddRmsNormOperands& ops) {
  return run_allreduce_pair(call, group, &ops);
}

at::Tensor run_fused_reduce_scatter(const CallArgs& call, c10d::ProcessGroup& group) {
  const int64_t world = group.getSize();
  std::vector<int64_t> shape = call.out_shape;  // dim 0 (check_fused) split over the ranks
  shape[0] /= world;
  if (call.m == 0) return device_queue().empty(shape, call.b.options());  // M = 0 launches nothing (check_fused)
  at::Tensor out = device_queue().empty({call.m / world, call.n}, call.b.options());
  launch_fused(call, group, kReduceScatterPair, out);
  return out.view(shape);
}

std::tuple<at::Tensor, at::Tensor> run_fused_allgather(const CallArgs& call, c10d::ProcessGroup& group) {
  const int64_t world = group.getSize();
  std::vector<int64_t> shape = call.out_shape;  // dim 0 (check_fused) gathered from the ranks
  shape[0] *= world;
  std::vector<int64_t> gathered_shape = shape;
  gathered_shape.back() = call.k;
  if (call.m == 0) {  // M = 0 launches nothing (check_fused)
    DeviceQueue& queue = device_queue();
    return std::make_tuple(queue.empty(shape, call.b.options()), queue.empty(gathered_shape, call.b.options()));
  }
  at::Tensor out = device_queue().empty({world * call.m, call.n}, call.b.options());
  const at::Tensor scratch = launch_fused(call, group, kAllgatherPair, out);
  // The comm kernel leaves the gathered a (world * M x K, row-major) at the start of the scratch.
  const int64_t gathered_bytes = world * call.m * call.k * static_cast<int64_t>(c10::elementSize(call.dtype));
  at::Tensor gathered = scratch.narrow(0, 0, gathered_bytes).view(call.dtype).view(gathered_shape);
  return std::make_tuple(out.view(shape), gathered);
}

std::vector<CallSignature> agree_fused(const CallArgs& call, Algorithm chosen, c10d::ProcessGroup& group) {
  const at::Device device = call_device(call);
  CommState& state = comm_state(group, device);  // set up already (check_fused runs first on every call)
  bool agreed = false;
  if (state.unavailable.empty()) {
    std::lock_guard<std::mutex> lock(state.mutex);
    agreed = state.agreed;
  }
  // A rank with bad arguments cannot know what `auto` would have chosen; on a group that runs `fused` it assumes
  // its peers run the kernels. An explicit `sequential` / `chunked` keeps the exchange its peers are in, and so
  // does a rank whose previous tuning call's clock failed: its peers are tuning the same bucket, over the host.
  const bool runs_kernels = chosen == Algorithm::Fused ||
                            (!call.error.empty() && chosen == Algorithm::Auto && call.error_code != kTuningClockError);
  if (!agreed || !runs_kernels) {
    // Setup (the group's first fused call) and the algorithms that do not run the kernels: the exchange over the
    // process group, which synchronises (rank_agreement.cpp). Its first success on a usable communicator ends it.
    std::vector<CallSignature> all = check_ranks_agree(group, call, chosen, device);
    if (chosen == Algorithm::Fused && state.unavailable.empty()) {
      std::lock_guard<std::mutex> lock(state.mutex);
      state.agreed = true;
    }
    return all;
  }
  if (chosen == Algorithm::Fused && call.error.empty() && call.m > 0) return {};  // run_fused: the kernels compare
  // A rank that rejected its arguments (or has M = 0) still takes part in the call through the window, so that
  // peers running the kernels stop at once with the reason instead of waiting out the timeout.
  c10::DeviceGuard device_guard(device);
  std::lock_guard<std::mutex> lock(state.mutex);
  KernelArgs args{};
  fill_call_header(&args, state, state.calls.take_epoch(), fused_signature(call, chosen, state));
  args.dtype = kDTypeFloat16;  // read by nobody: a signature-only call moves no data
  args.signature_only = 1;
  DeviceQueue& queue = device_queue();
  const c10::Stream caller = queue.current_stream(device.index());
  at::Tensor args_device = upload_args(args, device, state, caller);
  queue_in_group_order(state, caller, [&](const c10::Stream&, const c10::Stream& comm_stream) {
    queue.launch(comm_stream, Kernel::kGemmComm, static_cast<uint32_t>(state.comm_blocks), args_device.data_ptr());
    keep_alive_on(comm_stream, {args_device});
  });
  if (call.error.empty()) return {};  // M = 0: nothing to compute; a peer with M > 0 gets the mismatch
  // Raised right here; the kernel's record of this rank's own rejection is not raised again (KernelErrorWatch).
  TORCH_CHECK_NOT_IMPLEMENTED(!agreement_problem_is_not_implemented({}, call), call.error);
  if (!agreement_problem_is_value_error({}, call)) TORCH_CHECK(false, call.error);
  TORCH_CHECK_VALUE(false, call.error);
  return {};  // not reached
}

}  // namespace gemm_ar::npu
