// Runs the real GemmComputeKernel/GemmCommKernel protocol of several ranks in one process on pto-isa's CPU
// simulator: every rank has its own window buffer, scratch and error record, every block is a thread. Ranks run
// their calls back to back with no barrier in between (as streams would), except where the job asks for an
// "HCCL collective" between two calls: then all ranks meet, overwrite their windows and scratch with random bytes
// (what HCCL's own collectives may leave in the window), and meet again.
//
//   gemm_ar_sim info        prints "bf16_native 0|1" (g++ < 13 simulates bfloat16_t with a 16-bit float)
//   gemm_ar_sim run <dir>   runs <dir>/job.txt, writes c<call>_out<rank>.bin, prints one "result" line per call
//                           and rank: call rank code peer item block (code 0 = success; the rank's error
//                           record as it was right after its kernels of that call), a
//                           "lost_store_lines N" line (scalar stores no dcci published; sim_data_cache.hpp) and an
//                           "unfenced_flags N" line (flags raised after an unfenced payload store) and an
//                           "unfenced_accesses N" line (flag-guarded accesses with no acquire fence after the flag);
//                           "sync_waits_without_set N" and "sync_sets_unwaited N" lines (pipe events waited for with
//                           no set, or set and never waited for: a hang or a stale event on the device);
//                           <dir>/model_counters.txt: what the optional cache-model parts counted (evicted_lines,
//                           posted_writebacks, unfenced_writebacks, deferred_tile_stores, and the two sync_ counts
//                           again; sim_data_cache.hpp)
//
// Environment options of a run (the simulator test sets them; the cache model's own are in sim_data_cache.hpp):
// GEMM_AR_SIM_RESIDENT_COMM_BLOCKS=R lets at most R comm blocks of a rank run at once, the others starting as running
// ones end (a device with fewer free vector cores than blocks); GEMM_AR_SIM_CONCURRENT_CALLS=c runs call c + 1 on a
// second stream ("lane") of every rank at the same time as call c (a host that did not order two calls of one
// group): its own KernelArgs buffer, scratch and cores, the same windows and error record; calls c and c + 1 must
// then not skip a rank, be late or clobber, and the calls after them wait for both.
//
// job.txt: "world P Q dtype timeout_us window_offset seed topology [op]", "calls C", then C lines
//          "m n k b_layout has_bias lda ldb ldo epoch skip_rank clobber_after late_rank late_us sig_rank sig_word
//          sig_value bad_rank bad_code out_fill via_counter hccl_rank hccl_us".
// Inputs (raw little-endian): c<call>_a<rank>.bin (m*lda 16-bit), c<call>_b.bin (k*ldb or n*ldb 16-bit),
// c<call>_bias.bin (n float32; zero-padded here to pad_n like the host does). skip_rank >= 0 leaves that rank out of
// the call (a dead peer); late_rank >= 0 starts that rank's comm kernel only once every other rank's compute kernel of
// the call has finished, plus late_us (a late peer: the others have every tile ready and want to add into its subtiles
// before it has zeroed them; for the allgather only the delay, since the others' compute kernels wait for its rows).
// clobber_after 1 overwrites windows and scratch with random bytes after the call, 2 with the next call's tag in
// every 32-bit word (data that forges single-word flags).
// Call signatures (KernelArgs::signature) are what the NPU host publishes: word 0 the rank's error code, then M, K,
// N, dtype, bias, algorithm (3 = fused). sig_rank >= 0 sets word sig_word of that rank's signature to sig_value (a
// rank that called with another shape, dtype or algorithm); bad_rank >= 0 makes that rank a rank that rejected its
// arguments: a signature-only launch of the comm kernel with word 0 = bad_code, no plan, no output, no compute
// kernel, as the host does. topology 0 (MESH): every rank's CommContext is built directly, as HCCL returns it on A2;
// 1 (RING): from a fake HCCL op-resource block per rank by the host's own assemble_ring_context
// (csrc/host/npu/ring_context.cpp), as on A3; 2: RING with rank 1's record for rank 0 naming rank 2 (a layout HCCL
// moved), which the assembly must refuse ("ring_context_error", exit code 3); 3: MESH with rank 1's CommContext naming
// rank 0 (the kernel's attach fails); 4: MESH with no CommContext for rank 1 (its KernelArgs header is unusable).
// out_fill: the byte every output starts as (255: the NaN pattern; 0 to see poison).
// via_counter 1: the epoch reaches the kernels through KernelArgs::epoch_counter (as on the NPU host, where a graph
// replay repeats the KernelArgs bytes) while KernelArgs::epoch holds a different wrong value on every rank.
// hccl_rank >= 0 (HCCL traffic): that rank is still inside an HCCL collective on the communicator when the others
// start the call: its window from window_offset on holds the collective's bytes (a known pattern) until hccl_us
// after every other rank started the call, and only then does it launch its kernels; the bytes changed meanwhile
// (the others wrote into a window HCCL still owned) are printed as "hccl_traffic_clobbered call rank N". The others
// start the call once the bytes are in place.
// op (gemm_ar::OpKind, default 0 = gemm_allreduce): 1 runs GemmRsComputeKernel/GemmRsCommKernel (m is every
// rank's full M, out<rank> its m / world rows), 2 runs AgGemmComputeKernel/AgGemmCommKernel (m is each rank's
// shard, out<rank> world * m rows, and c<call>_gathered<rank>.bin the gathered a the host would return).
// op 3 (kSimAddRmsNorm, the host's kOpGemmAllreduceAddRmsnorm) runs gemm_allreduce's pair with the add+RMSNorm
// epilogue (gemm_ar/epilogue_args.hpp): the job line then ends "3 eps"; c<call>_residual.bin (m x ldo 16-bit, the
// same for every rank) and c<call>_weight.bin (n 16-bit) are its operands; out<rank> is reduced + residual and
// c<call>_normed<rank>.bin (m x ldo, starting as out_fill) the normalised rows. An eps after op 1 or 2 attaches the
// same epilogue arguments to that op's kernels (which must refuse them).
// op 4 (kSimDecode) runs gemm_allreduce's pair in the decode variant (KernelArgs::variant = kVariantDecode,
// plan_decode_kernel_args: m <= 64), the variant also in signature word 15 as the NPU host puts it there; with an
// eps, the decode variant with the add+RMSNorm epilogue (signed as op 3 is).
#include <pto/pto-inst.hpp>

#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <type_traits>
#include <random>
#include <semaphore>
#include <string>
#include <thread>
#include <vector>

#include "gemm_ar/kernel_args.hpp"
#include "gemm_ar/sequence_parallel.hpp"
#include "kernel_entry.h"
#include "sp_kernel_entry.h"
#include "npu/hccl_context_layout.h"
#include "npu/ring_context.h"
#include "sim_data_cache.hpp"

namespace {

struct CallSpec {
  int64_t m, n, k;
  uint32_t b_layout;
  int has_bias;
  int64_t lda, ldb, ldo;
  uint32_t epoch;
  int skip_rank;
  int clobber_after;
  int late_rank;
  int64_t late_us;
  int sig_rank, sig_word;
  int64_t sig_value;
  int bad_rank;
  int64_t bad_code;
  int out_fill;
  int via_counter;
  int hccl_rank;
  int64_t hccl_us;
};

constexpr uint32_t kSimAddRmsNorm = 3;  // Job::op of gemm_allreduce with the add+RMSNorm epilogue
constexpr uint32_t kSimDecode = 4;      // Job::op of gemm_allreduce's pair in the decode variant (kVariantDecode)
constexpr int kSigEngineMode = 15;      // the host's signature word that carries KernelArgs::variant on the NPU

struct Job {
  int world = 0, compute_blocks = 0, comm_blocks = 0, topology = 0;
  uint32_t op = 0;        // 0: gemm_allreduce; kSimAddRmsNorm; else the OpKind of a sequence-parallel kernel pair
  bool epilogue = false;  // an eps followed the op: every call carries the add+RMSNorm epilogue arguments
  float eps = 0;
  uint32_t dtype = 0, timeout_us = 0;
  uint64_t window_offset = 0, seed = 0;
  std::vector<CallSpec> calls;
};

struct Aligned {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit Aligned(size_t n) : bytes((n + 511) / 512 * 512) { ptr = std::aligned_alloc(512, bytes); }
  ~Aligned() { std::free(ptr); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  uint64_t addr() const { return reinterpret_cast<uint64_t>(ptr); }
};

void fill_random(void* p, size_t bytes, std::mt19937_64& rng) {
  auto* b = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < bytes; ++i) b[i] = static_cast<unsigned char>(rng());
}

void fill_words(void* p, size_t bytes, uint32_t word) {
  auto* w = static_cast<uint32_t*>(p);
  for (size_t i = 0; i < bytes / sizeof(uint32_t); ++i) w[i] = word;
}

std::vector<unsigned char> read_file(const std::string& path, size_t bytes) {
  std::vector<unsigned char> data(bytes);
  std::ifstream f(path, std::ios::binary);
  if (!f.read(reinterpret_cast<char*>(data.data()), static_cast<std::streamsize>(bytes))) {
    std::fprintf(stderr, "cannot read %zu bytes from %s\n", bytes, path.c_str());
    std::exit(2);
  }
  return data;
}

void write_file(const std::string& path, const void* p, size_t bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(p), static_cast<std::streamsize>(bytes));
}

Job read_job(const std::string& dir) {
  Job job;
  std::ifstream f(dir + "/job.txt");
  std::string word;
  int calls = 0;
  f >> job.world >> job.compute_blocks >> job.comm_blocks >> job.dtype >> job.timeout_us >> job.window_offset >>
      job.seed >> job.topology >> word;
  if (word != "calls") {  // optional: the op (gemm_ar::OpKind; absent or 0 = gemm_allreduce)
    job.op = static_cast<uint32_t>(std::stoul(word));
    f >> word;
    if (word != "calls") {  // optional: eps, and with it the epilogue
      job.epilogue = true;
      job.eps = std::stof(word);
      f >> word;
    }
  }
  f >> calls;
  if (!f || word != "calls" || (job.op == kSimAddRmsNorm && !job.epilogue)) {
    std::fprintf(stderr, "bad job.txt\n");
    std::exit(2);
  }
  for (int c = 0; c < calls; ++c) {
    CallSpec s{};
    f >> s.m >> s.n >> s.k >> s.b_layout >> s.has_bias >> s.lda >> s.ldb >> s.ldo >> s.epoch >> s.skip_rank >>
        s.clobber_after >> s.late_rank >> s.late_us >> s.sig_rank >> s.sig_word >> s.sig_value >> s.bad_rank >>
        s.bad_code >> s.out_fill >> s.via_counter >> s.hccl_rank >> s.hccl_us;
    if (s.hccl_rank >= job.world || (s.hccl_rank >= 0 && s.hccl_rank == s.skip_rank)) {
      std::fprintf(stderr, "hccl_rank must be a rank that takes part in the call\n");
      std::exit(2);
    }
    job.calls.push_back(s);
  }
  if (!f) {
    std::fprintf(stderr, "bad call line in job.txt\n");
    std::exit(2);
  }
  return job;
}

gemm_ar::KernelArgs base_args(const Job& job, const CallSpec& s, int rank) {
  gemm_ar::KernelArgs a{};
  a.magic = gemm_ar::kKernelArgsMagic;
  a.dtype = job.dtype;
  a.b_layout = s.b_layout;
  a.epoch = s.epoch;
  a.lda = s.lda;
  a.ldb = s.ldb;
  a.ldo = s.ldo;
  a.rank = rank;
  a.world = job.world;
  a.compute_blocks = job.compute_blocks;
  a.comm_blocks = job.comm_blocks;
  a.bias_rank = 0;
  a.wait_timeout_us = job.timeout_us;
  // Sequence-parallel ops: one row chunk per rank, the rank's rows (reduce-scatter: m is every rank's full M) or shard
  // (allgather: m is each rank's shard).
  const int64_t m_sub = job.op == gemm_ar::kOpGemmReduceScatter ? s.m / job.world : s.m;
  const bool sequence_parallel = job.op == gemm_ar::kOpGemmReduceScatter || job.op == gemm_ar::kOpAllgatherGemm;
  const bool planned = sequence_parallel      ? gemm_ar::plan_sp_kernel_args(&a, job.op, m_sub, s.n, s.k)
                       : job.op == kSimDecode ? gemm_ar::plan_decode_kernel_args(&a, s.m, s.n, s.k)
                                              : gemm_ar::plan_kernel_args(&a, s.m, s.n, s.k);
  if (!planned) {
    std::fprintf(stderr, "plan_kernel_args rejected m=%lld n=%lld k=%lld\n", static_cast<long long>(s.m),
                 static_cast<long long>(s.n), static_cast<long long>(s.k));
    std::exit(2);
  }
  a.signature[1] = s.m;
  a.signature[2] = s.k;
  a.signature[3] = s.n;
  a.signature[4] = job.dtype;
  a.signature[5] = s.has_bias;
  a.signature[6] = 3;  // Algorithm::Fused
  // kSigOp (the host's OpKind); word 13, the dim, is 0 (add+RMSNorm: eps's bits)
  // The decode variant with the epilogue is the host's gemm_allreduce_add_rmsnorm, as op 3 is.
  const bool add_rmsnorm = job.op == kSimAddRmsNorm || (job.op == kSimDecode && job.epilogue);
  a.signature[12] = add_rmsnorm            ? gemm_ar::kOpGemmAllreduceAddRmsnorm
                    : job.op == kSimDecode ? gemm_ar::kOpGemmAllreduce
                                           : job.op;
  a.signature[kSigEngineMode] = a.variant;
  if (add_rmsnorm) {
    const double eps = job.eps;
    std::memcpy(&a.signature[13], &eps, sizeof eps);
  }
  if (s.sig_rank >= 0 && rank == s.sig_rank && s.sig_word >= 0 && s.sig_word < gemm_ar::kSignatureWords) {
    a.signature[s.sig_word] = s.sig_value;
  }
  if (s.bad_rank >= 0 && rank == s.bad_rank) {
    // What the host launches for a rank whose arguments failed its checks: no plan, nothing to read or write.
    a.signature_only = 1;
    a.signature[0] = s.bad_code;
    a.plan = gemm_ar::TilePlan{};
    a.chunks = gemm_ar::RowChunks{};
    a.layout = gemm_ar::KernelLayout{};
  }
  return a;
}

// One "kernel launch": block_count threads, each with its block index set as the simulator expects and running as
// the simulated core whose data cache is cores[b] (kept across launches, as hardware keeps lines across kernels).
// `resident` (GEMM_AR_SIM_RESIDENT_COMM_BLOCKS): a block starts only once it gets one of the rank's free cores.
template <typename Kernel>
std::vector<std::thread> launch(Kernel kernel, int block_count, gemm_ar::KernelArgs* args,
                                gemm_ar::device::sim_cache::CoreCache* cores,
                                std::counting_semaphore<>* resident = nullptr) {
  std::vector<std::thread> threads;
  for (int b = 0; b < block_count; ++b) {
    threads.emplace_back([kernel, b, args, cores, resident]() {
      if (resident != nullptr) resident->acquire();
      pto::cpu_sim::set_execution_context(static_cast<uint32_t>(b), 0, 1);
      gemm_ar::device::sim_cache::bind_core(&cores[b]);
      kernel(reinterpret_cast<__gm__ uint8_t*>(args));
      cores[b].retire_dirty();  // stores the kernel never published are lost, the lines stay cached
      gemm_ar::device::sim_cache::bind_core(nullptr);
      if (resident != nullptr) resident->release();
    });
  }
  return threads;
}

int run(const std::string& dir) {
  const Job job = read_job(dir);
  const int world = job.world;
  const size_t elem = 2;

  // Size every buffer for the largest call: windows, scratch and records persist across calls like the real ones.
  int64_t window_bytes = 0, scratch_bytes = 0;
  for (const CallSpec& s : job.calls) {
    const gemm_ar::KernelArgs a = base_args(job, s, -1);  // -1: no rank's overrides
    window_bytes = std::max(window_bytes, a.layout.window_bytes);
    scratch_bytes = std::max(scratch_bytes, a.layout.scratch_bytes);
  }
  const size_t window_alloc = job.window_offset + static_cast<size_t>(window_bytes) + 4096;
  std::mt19937_64 rng(job.seed);
  std::vector<std::unique_ptr<Aligned>> windows, scratch, records;
  std::vector<gemm_ar::CommContext> contexts(world);
  for (int r = 0; r < world; ++r) {
    windows.emplace_back(new Aligned(window_alloc));
    scratch.emplace_back(new Aligned(static_cast<size_t>(scratch_bytes)));
    records.emplace_back(new Aligned(sizeof(gemm_ar::ErrorRecord)));
    fill_random(windows[r]->ptr, windows[r]->bytes, rng);  // never-zeroed memory, as on the device
    fill_random(scratch[r]->ptr, scratch[r]->bytes, rng);
    fill_random(records[r]->ptr, records[r]->bytes, rng);
  }
  // GEMM_AR_SIM_CONCURRENT_CALLS: lane 1 gets its own scratch (the host allocates one per call); scratch, KernelArgs
  // buffers, cores and epoch counters are indexed by slot = lane * world + rank.
  const char* concurrent_env = std::getenv("GEMM_AR_SIM_CONCURRENT_CALLS");
  const int64_t concurrent = concurrent_env != nullptr ? std::atoll(concurrent_env) : -1;
  const int lanes = concurrent >= 0 && concurrent + 1 < static_cast<int64_t>(job.calls.size()) ? 2 : 1;
  for (int r = 0; r < world * (lanes - 1); ++r) {
    scratch.emplace_back(new Aligned(static_cast<size_t>(scratch_bytes)));
    fill_random(scratch.back()->ptr, scratch.back()->bytes, rng);
  }
  namespace hccl = gemm_ar::npu::hccl_layout;
  std::vector<std::vector<unsigned char>> ring_blocks(world);
  std::vector<std::vector<hccl::RankRelationResV2>> relations(world, std::vector<hccl::RankRelationResV2>(world));
  for (int r = 0; r < world; ++r) {
    gemm_ar::CommContext& ctx = contexts[r];
    std::memset(&ctx, 0, sizeof(ctx));
    if (job.topology == 0 || job.topology >= 3) {
      ctx.rank_id = static_cast<uint32_t>(job.topology == 3 && r == 1 ? 0 : r);
      ctx.rank_num = static_cast<uint32_t>(world);
      ctx.win_size = windows[r]->bytes;
      for (int p = 0; p < world; ++p) ctx.windows_in[p] = windows[p]->addr();
      continue;
    }
    // What HCCL hands out on RING: OpResParam with this rank's windows, and per peer a rank-relation record.
    std::vector<unsigned char>& block = ring_blocks[r];
    block.assign(sizeof(hccl::OpResParam) + static_cast<size_t>(world) * sizeof(hccl::RemoteResPtr), 0);
    auto* param = reinterpret_cast<hccl::OpResParam*>(block.data());
    param->localUsrRankId = static_cast<uint32_t>(r);
    param->rankSize = static_cast<uint32_t>(world);
    param->winSize = windows[r]->bytes;
    param->localWindowsIn = windows[r]->addr();
    auto* remote = reinterpret_cast<hccl::RemoteResPtr*>(block.data() + offsetof(hccl::OpResParam, remoteRes));
    for (int p = 0; p < world; ++p) {
      if (p == r) continue;
      relations[r][p].remoteUsrRankId = static_cast<uint32_t>(job.topology == 2 && r == 1 && p == 0 ? 2 : p);
      relations[r][p].windowsIn = windows[p]->addr();
      remote[p].nextDevicePtr = reinterpret_cast<uint64_t>(&relations[r][p]);
    }
    try {
      gemm_ar::npu::assemble_ring_context(block.data(), &ctx,
                                          [](void* host, const void* device, size_t bytes, const char*) {
                                            std::memcpy(host, device, bytes);
                                          });
    } catch (const gemm_ar::npu::RingContextError& e) {
      std::printf("ring_context_error %s\n", e.what());
      return 3;
    }
  }

  // Inputs and outputs of every call, loaded up front so the ranks run without pauses between calls.
  const size_t calls = job.calls.size();
  std::vector<std::vector<std::vector<unsigned char>>> a_in(calls), out(calls);
  std::vector<std::vector<unsigned char>> b_in(calls), bias_in(calls), residual_in(calls), weight_in(calls);
  std::vector<std::vector<std::vector<unsigned char>>> normed(calls);
  for (size_t c = 0; c < calls; ++c) {
    const CallSpec& s = job.calls[c];
    const std::string pre = dir + "/c" + std::to_string(c) + "_";
    const int64_t b_rows = s.b_layout == gemm_ar::kBTransposed ? s.n : s.k;
    b_in[c] = read_file(pre + "b.bin", static_cast<size_t>(b_rows * s.ldb) * elem);
    if (s.has_bias) {
      // The kernels take the bias as fp32 padded with zeros to pad_n, as the host prepares it.
      const gemm_ar::KernelArgs a = base_args(job, s, -1);  // -1: no rank's overrides
      bias_in[c] = read_file(pre + "bias.bin", static_cast<size_t>(s.n) * sizeof(float));
      bias_in[c].resize(static_cast<size_t>(a.plan.pad_n) * sizeof(float), 0);
    }
    if (job.epilogue) {
      residual_in[c] = read_file(pre + "residual.bin", static_cast<size_t>(s.m * s.ldo) * elem);
      weight_in[c] = read_file(pre + "weight.bin", static_cast<size_t>(s.n) * elem);
      normed[c].assign(world, std::vector<unsigned char>(static_cast<size_t>(s.m * s.ldo) * elem,
                                                         static_cast<unsigned char>(s.out_fill)));
    }
    for (int r = 0; r < world; ++r) {
      a_in[c].push_back(read_file(pre + "a" + std::to_string(r) + ".bin", static_cast<size_t>(s.m * s.lda) * elem));
      // 0xFF: the NaN pattern, unwritten stays NaN; 0 where a test wants to see the kernel's poison.
      const int64_t out_rows = job.op == gemm_ar::kOpGemmReduceScatter ? s.m / world
                               : job.op == gemm_ar::kOpAllgatherGemm   ? s.m * world
                                                                       : s.m;
      out[c].emplace_back(static_cast<size_t>(out_rows * s.ldo) * elem, static_cast<unsigned char>(s.out_fill));
    }
  }

  // One KernelArgs buffer per rank, rewritten for every call (as a caching allocator hands the same block back): a
  // kernel that read it without dropping its cached lines would see the previous call's arguments.
  struct alignas(64) ArgsSlot {
    gemm_ar::KernelArgs a;
  };
  std::vector<ArgsSlot> args(world * lanes);
  // Each rank's simulated cores (compute blocks, then comm blocks) and their data caches, for the whole run.
  using gemm_ar::device::sim_cache::CoreCache;
  std::vector<std::unique_ptr<CoreCache[]>> compute_cores(world * lanes), comm_cores(world * lanes);
  for (int r = 0; r < world * lanes; ++r) {
    compute_cores[r].reset(new CoreCache[job.compute_blocks]);
    comm_cores[r].reset(new CoreCache[job.comm_blocks]);
  }
  std::vector<std::vector<std::vector<unsigned char>>> gathered(calls, std::vector<std::vector<unsigned char>>(world));
  std::vector<std::atomic<int>> computed(calls);  // compute kernels finished, per call
  for (auto& n : computed) n.store(0);
  std::vector<int64_t> counters(world * lanes, 0);  // KernelArgs::epoch_counter, one per rank (and lane)
  // GEMM_AR_SIM_RESIDENT_COMM_BLOCKS: a rank's free cores for its comm blocks.
  const int resident_cap = std::getenv("GEMM_AR_SIM_RESIDENT_COMM_BLOCKS") != nullptr
                               ? std::atoi(std::getenv("GEMM_AR_SIM_RESIDENT_COMM_BLOCKS"))
                               : 0;
  std::vector<std::unique_ptr<std::counting_semaphore<>>> resident(world);
  for (auto& cores : resident) {
    if (resident_cap > 0) cores.reset(new std::counting_semaphore<>(resident_cap));
  }
  // GEMM_AR_SIM_CONCURRENT_CALLS: whether this lane runs call c. Lane 1 runs only call concurrent + 1, starting
  // once lane 0 of its rank starts call `concurrent`; lane 0 skips it and waits for it before its next call.
  std::vector<std::atomic<int>> lane_gate(world);  // per rank: 1 = lane 0 started call `concurrent`, 2 = lane 1 done
  for (auto& gate : lane_gate) gate.store(0);
  const auto lane_runs = [&](size_t c, int r, int lane) {
    if (lanes == 1) return true;
    const int64_t i = static_cast<int64_t>(c);
    if (lane == 1) {
      if (i != concurrent + 1) return false;
      while (lane_gate[r].load() == 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
      return true;
    }
    if (i == concurrent) lane_gate[r].store(1);
    if (i == concurrent + 2) {
      while (lane_gate[r].load() != 2) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return i != concurrent + 1;
  };
  // Each rank's error record as its host would read it after the call's kernels (a later call may overwrite it).
  std::vector<std::vector<gemm_ar::ErrorRecord>> records_after(calls, std::vector<gemm_ar::ErrorRecord>(world));
  // HCCL traffic (hccl_rank): the rank in the collective fills its window region and holds it; the others wait for
  // the fill (the collective began before they started the call), then go on while the rank is still "in" it.
  std::vector<std::atomic<int>> hccl_in_place(calls), hccl_others_started(calls);
  for (size_t c = 0; c < calls; ++c) {
    hccl_in_place[c].store(0);
    hccl_others_started[c].store(0);
  }
  std::vector<long long> hccl_clobbered(calls, -1);
  const auto hccl_traffic = [&](size_t c, int r) {
    const CallSpec& s = job.calls[c];
    if (s.hccl_rank < 0) return;
    if (s.hccl_rank != r) {
      while (hccl_in_place[c].load() == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      hccl_others_started[c].fetch_add(1);
      return;
    }
    auto* region = static_cast<unsigned char*>(windows[r]->ptr) + job.window_offset;
    const size_t bytes = windows[r]->bytes - job.window_offset;
    std::vector<unsigned char> pattern(bytes);
    std::mt19937_64 collective(job.seed * 7 + c);
    fill_random(pattern.data(), bytes, collective);
    for (size_t i = 0; i < bytes; ++i) __atomic_store_n(region + i, pattern[i], __ATOMIC_RELAXED);
    hccl_in_place[c].store(1);  // the fill happens-before every other rank's launch of this call
    const int others = world - 1 - (s.skip_rank >= 0 ? 1 : 0);
    while (hccl_others_started[c].load() < others) std::this_thread::sleep_for(std::chrono::microseconds(200));
    std::this_thread::sleep_for(std::chrono::microseconds(s.hccl_us));
    long long changed = 0;
    for (size_t i = 0; i < bytes; ++i) changed += __atomic_load_n(region + i, __ATOMIC_RELAXED) != pattern[i];
    hccl_clobbered[c] = changed;
  };
  std::barrier meet(world);
  std::vector<std::thread> ranks;
  for (int slot = 0; slot < world * lanes; ++slot) {
    const int r = slot % world, lane = slot / world;
    ranks.emplace_back([&, r, lane, slot]() {
      std::mt19937_64 jitter(job.seed * 7919 + static_cast<uint64_t>(slot));
      std::mt19937_64 garbage(job.seed * 104729 + static_cast<uint64_t>(r));
      for (size_t c = 0; c < calls; ++c) {
        if (!lane_runs(c, r, lane)) continue;
        const CallSpec& s = job.calls[c];
        if (s.skip_rank != r) {
          hccl_traffic(c, r);  // before this rank launches anything of the call
          gemm_ar::KernelArgs& a = args[slot].a;
          a = base_args(job, s, r);
          a.a = reinterpret_cast<uint64_t>(a_in[c][r].data());
          a.b = reinterpret_cast<uint64_t>(b_in[c].data());
          a.bias = s.has_bias ? reinterpret_cast<uint64_t>(bias_in[c].data()) : 0;
          a.out = s.bad_rank == r ? 0 : reinterpret_cast<uint64_t>(out[c][r].data());
          a.comm_ctx = job.topology == 4 && r == 1 ? 0 : reinterpret_cast<uint64_t>(&contexts[r]);
          a.window_offset = job.window_offset;
          a.window_bytes = window_alloc - job.window_offset;
          a.scratch = scratch[slot]->addr();
          a.error = records[r]->addr();
          if (job.epilogue && s.bad_rank != r) {
            a.epilogue.kind = gemm_ar::kEpilogueAddRmsNorm;
            a.epilogue.eps = job.eps;
            a.epilogue.residual = reinterpret_cast<uint64_t>(residual_in[c].data());
            a.epilogue.norm_weight = reinterpret_cast<uint64_t>(weight_in[c].data());
            a.epilogue.normed = reinterpret_cast<uint64_t>(normed[c][r].data());
            a.epilogue.ld_residual = s.ldo;
            a.epilogue.ld_normed = s.ldo;
          }
          if (s.via_counter) {
            counters[slot] = static_cast<int64_t>(s.epoch);  // the host's add_ after the previous call
            a.epoch_counter = reinterpret_cast<uint64_t>(&counters[slot]);
            a.epoch = s.epoch + 1000u + static_cast<uint32_t>(r);  // what a replay would carry: stale, per rank
          }
          const auto compute_kernel = job.op == gemm_ar::kOpGemmReduceScatter ? GemmRsComputeKernel
                                      : job.op == gemm_ar::kOpAllgatherGemm   ? AgGemmComputeKernel
                                                                              : GemmComputeKernel;
          const auto comm_kernel = job.op == gemm_ar::kOpGemmReduceScatter ? GemmRsCommKernel
                                   : job.op == gemm_ar::kOpAllgatherGemm   ? AgGemmCommKernel
                                                                           : GemmCommKernel;
          const auto run_compute = [&]() {
            return launch(compute_kernel, job.compute_blocks, &a, compute_cores[slot].get());
          };
          const auto run_comm = [&]() {
            return launch(comm_kernel, job.comm_blocks, &a, comm_cores[slot].get(), resident[r].get());
          };
          if (s.bad_rank == r) {
            std::vector<std::thread> comm = run_comm();
            for (auto& t : comm) t.join();
            computed[c].fetch_add(1);
          } else if (s.late_rank == r) {
            std::vector<std::thread> compute = run_compute();
            const int others = world - 1 - (s.skip_rank >= 0 ? 1 : 0);
            // Allgather: the others' compute kernels need this rank's rows, so only the delay applies there.
            while (job.op != gemm_ar::kOpAllgatherGemm && computed[c].load() < others) {
              std::this_thread::sleep_for(std::chrono::milliseconds(1));
            }
            std::this_thread::sleep_for(std::chrono::microseconds(s.late_us));
            std::vector<std::thread> comm = run_comm();
            for (auto& t : compute) t.join();
            for (auto& t : comm) t.join();
          } else {
            // Either kernel may start first, as with two streams.
            const int order = static_cast<int>(jitter() % 2);
            std::this_thread::sleep_for(std::chrono::microseconds(jitter() % 2000));
            std::vector<std::thread> first = order == 0 ? run_compute() : run_comm();
            std::this_thread::sleep_for(std::chrono::microseconds(jitter() % 2000));
            std::vector<std::thread> second = order == 0 ? run_comm() : run_compute();
            std::vector<std::thread>& compute = order == 0 ? first : second;
            for (auto& t : compute) t.join();
            computed[c].fetch_add(1);
            for (auto& t : first) {
              if (t.joinable()) t.join();
            }
            for (auto& t : second) {
              if (t.joinable()) t.join();
            }
          }
          if (job.op == gemm_ar::kOpAllgatherGemm && s.bad_rank != r) {
            // The gathered a the host returns: the scratch's first world * m x k elements.
            const size_t bytes = static_cast<size_t>(world * s.m * s.k) * elem;
            gathered[c][r].assign(static_cast<unsigned char*>(scratch[slot]->ptr),
                                  static_cast<unsigned char*>(scratch[slot]->ptr) + bytes);
          }
          std::memcpy(&records_after[c][r], records[r]->ptr, sizeof(gemm_ar::ErrorRecord));
        }
        if (s.clobber_after) {
          meet.arrive_and_wait();
          if (s.clobber_after == 2 && c + 1 < calls) {
            // Forged flags: every 32-bit word holds the next call's tag, as data that happens to equal it would.
            const uint32_t tag = gemm_ar::signal_tag(job.calls[c + 1].epoch);
            fill_words(windows[r]->ptr, windows[r]->bytes, tag);
            fill_words(scratch[r]->ptr, scratch[r]->bytes, tag);
          } else {
            fill_random(windows[r]->ptr, windows[r]->bytes, garbage);
            fill_random(scratch[r]->ptr, scratch[r]->bytes, garbage);
          }
          meet.arrive_and_wait();
        }
      }
      if (lane == 1) lane_gate[r].store(2);  // lane 0 may go on past the concurrent pair
    });
  }
  for (auto& t : ranks) t.join();

  for (size_t c = 0; c < calls; ++c) {
    for (int r = 0; r < world; ++r) {
      write_file(dir + "/c" + std::to_string(c) + "_out" + std::to_string(r) + ".bin", out[c][r].data(),
                 out[c][r].size());
      if (job.epilogue) {
        write_file(dir + "/c" + std::to_string(c) + "_normed" + std::to_string(r) + ".bin", normed[c][r].data(),
                   normed[c][r].size());
      }
      if (job.op == gemm_ar::kOpAllgatherGemm) {
        write_file(dir + "/c" + std::to_string(c) + "_gathered" + std::to_string(r) + ".bin", gathered[c][r].data(),
                   gathered[c][r].size());
      }
    }
  }
  // Scalar stores that no dcci ever wrote back (strict cache model): each is a flag or record nobody could see.
  std::printf("lost_store_lines %llu\n",
              static_cast<unsigned long long>(gemm_ar::device::sim_cache::lost_store_lines().load()));
  // Flags raised after a payload DMA store with no release fence in between (ordering model, sim_data_cache.hpp).
  std::printf("unfenced_flags %llu\n",
              static_cast<unsigned long long>(gemm_ar::device::sim_cache::unfenced_flags().load()));
  // Accesses guarded by a flag with no acquire fence after the flag was seen (ordering model, sim_data_cache.hpp).
  std::printf("unfenced_accesses %llu\n",
              static_cast<unsigned long long>(gemm_ar::device::sim_cache::unfenced_accesses().load()));
  std::printf("sync_waits_without_set %llu\nsync_sets_unwaited %llu\n",
              static_cast<unsigned long long>(gemm_ar::device::sim_cache::sync_waits_without_set().load()),
              static_cast<unsigned long long>(gemm_ar::device::sim_cache::sync_sets_unwaited().load()));
  {
    // The optional cache-model parts (sim_data_cache.hpp) a run turned on by environment, and what they saw.
    namespace model = gemm_ar::device::sim_cache;
    std::ofstream counters(dir + "/model_counters.txt");
    counters << "evicted_lines " << model::evicted_lines().load() << "\nposted_writebacks "
             << model::posted_writebacks().load() << "\nunfenced_writebacks " << model::unfenced_writebacks().load()
             << "\nsync_waits_without_set " << model::sync_waits_without_set().load() << "\nsync_sets_unwaited "
             << model::sync_sets_unwaited().load() << "\ndeferred_tile_stores " << model::deferred_tile_stores().load()
             << "\n";
  }
  for (size_t c = 0; c < calls; ++c) {
    if (job.calls[c].hccl_rank < 0) continue;
    std::printf("hccl_traffic_clobbered %zu %d %lld\n", c, job.calls[c].hccl_rank, hccl_clobbered[c]);
  }
  // Error records are per rank and tagged with the call that wrote them; report each call's own.
  for (size_t c = 0; c < calls; ++c) {
    for (int r = 0; r < world; ++r) {
      const gemm_ar::ErrorRecord* rec = &records_after[c][r];
      const bool mine = job.calls[c].skip_rank != r && rec->tag == gemm_ar::signal_tag(job.calls[c].epoch);
      std::printf("result %zu %d %d %d %lld %d\n", c, r, mine ? rec->code : 0, mine ? rec->peer : -1,
                  mine ? static_cast<long long>(rec->item) : -1LL, mine ? rec->block : -1);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "info") == 0) {
    // pto-isa falls back to a 16-bit IEEE half for bfloat16_t where <stdfloat> has no std::bfloat16_t.
    std::printf("bf16_native %d\n", std::is_same<bfloat16_t, half>::value ? 0 : 1);
    return 0;
  }
  if (argc >= 3 && std::strcmp(argv[1], "run") == 0) return run(argv[2]);
  std::fprintf(stderr, "usage: %s info | run <job dir>\n", argv[0]);
  return 2;
}
