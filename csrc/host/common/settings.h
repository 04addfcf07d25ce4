// The run-time knobs (TORCH_GEMM_AR_* environment variables), one registry: every knob the library reads is a line
// of GEMM_AR_SETTING_LIST, and the readers below take a Setting, not a name, so an unregistered knob cannot be read.
// docs/usage.md, "Configuration", documents each line (tests/test_settings.py keeps the two equal); _C._settings()
// lists them with their values in this process.
#pragma once
#include <chrono>
#include <cstdint>

// X(enumerator, variable, default, when it is read, what it sets)
#define GEMM_AR_SETTING_LIST(X)                                                                                       \
  X(kTimeoutS, "TORCH_GEMM_AR_TIMEOUT_S", "300", "at every wait", "bound of every wait on a peer, seconds")           \
  X(kProbeTimeoutS, "TORCH_GEMM_AR_PROBE_TIMEOUT_S", "120", "at each probe (Python: torch_gemm_ar/nn)",               \
    "bound of the converters' probes of a layer on all ranks, seconds")                                               \
  X(kCompileAgreeS, "TORCH_GEMM_AR_COMPILE_AGREE_S", "60", "at each compile with a rewrite site (Python: compile/)",  \
    "bound of the compile rewrite's wait for the group's ranks at its sites, seconds")                                \
  X(kChunks, "TORCH_GEMM_AR_CHUNKS", "4", "at each chunked call and when auto lists its candidates",                  \
    "chunks of the chunked algorithm")                                                                                \
  X(kCpuTile, "TORCH_GEMM_AR_CPU_TILE", "per-call rules", "at each CPU engine call",                                  \
    "CPU engine tile rows,columns,subtile rows for every call")                                                       \
  X(kComputeThreads, "TORCH_GEMM_AR_COMPUTE_THREADS", "this rank's share of the cores", "at each CPU engine call",    \
    "CPU engine compute blocks")                                                                                      \
  X(kCommThreads, "TORCH_GEMM_AR_COMM_THREADS", "0 on one core, else 1", "at each CPU engine call",                   \
    "CPU engine comm threads (0: between tiles on the caller's thread)")                                              \
  X(kCpuEngine, "TORCH_GEMM_AR_CPU_ENGINE", "1", "when a group's engine is set up",                                   \
    "0: no shared-memory engine for groups set up from then on")                                                      \
  X(kPackedBMaxMb, "TORCH_GEMM_AR_PACKED_B_MAX_MB", "256", "at each CPU engine call",                                 \
    "largest packed B panels, MB (0: at::mm for every tile)")                                                         \
  X(kSharedOutputs, "TORCH_GEMM_AR_SHARED_OUTPUTS", "0", "once per process",                                          \
    "CPU engine output slots per window (peers copy an owner's rows from its output)")                                \
  X(kOutputCacheMb, "TORCH_GEMM_AR_OUTPUT_CACHE_MB", "512", "once per process",                                       \
    "freed engine outputs kept for reuse, MB")                                                                        \
  X(kAutotune, "TORCH_GEMM_AR_AUTOTUNE", "1", "at each auto call and by tune()",                                      \
    "auto by measurement (0: the static policy)")                                                                     \
  X(kAutotuneReps, "TORCH_GEMM_AR_AUTOTUNE_REPS", "3", "while a bucket is tuned",                                     \
    "counted runs per candidate, at least")                                                                           \
  X(kAutotuneMaxReps, "TORCH_GEMM_AR_AUTOTUNE_MAX_REPS", "25", "while a bucket is tuned",                             \
    "counted runs per candidate, at most")                                                                            \
  X(kAutotuneBudgetMs, "TORCH_GEMM_AR_AUTOTUNE_BUDGET_MS", "2000", "while a bucket is tuned",                         \
    "more rounds while a bucket's tuning took less than this, milliseconds")                                          \
  X(kTuneCache, "TORCH_GEMM_AR_TUNE_CACHE", "$XDG_CACHE_HOME/torch_gemm_ar/autotune.json",                            \
    "when decisions are looked up or written", "the file of auto's decisions")                                        \
  X(kAutoMinFusedElems, "TORCH_GEMM_AR_AUTO_MIN_FUSED_ELEMS", "1", "at each auto call on the static policy",          \
    "CPU: output elements from which the static auto takes fused")                                                    \
  X(kAutoMinChunkedRows, "TORCH_GEMM_AR_AUTO_MIN_CHUNKED_ROWS", "never", "at each auto call on the static policy",    \
    "CPU: rows from which the static auto takes chunked where fused is unavailable")                                  \
  X(kNpuFusedMinRows, "TORCH_GEMM_AR_NPU_FUSED_MIN_ROWS", "64", "at each auto call on the static policy (NPU)",       \
    "NPU: rows below which auto takes sequential")                                                                    \
  X(kNpuComputeBlocks, "TORCH_GEMM_AR_NPU_COMPUTE_BLOCKS", "cube cores", "when a communicator's NPU state is set up", \
    "NPU: GEMM blocks")                                                                                               \
  X(kNpuCommBlocks, "TORCH_GEMM_AR_NPU_COMM_BLOCKS", "vector cores / 2", "when a communicator's NPU state is set up", \
    "NPU: communication blocks")                                                                                      \
  X(kNpuSyncErrors, "TORCH_GEMM_AR_NPU_SYNC_ERRORS", "0", "at each NPU fused call",                                   \
    "NPU: 1 waits for every fused call's kernels and raises its failure at once")

namespace gemm_ar {

enum class Setting : int {
#define GEMM_AR_SETTING_ENUM(id, variable, initial, when, what) id,
  GEMM_AR_SETTING_LIST(GEMM_AR_SETTING_ENUM)
#undef GEMM_AR_SETTING_ENUM
};

struct SettingInfo {
  const char* variable;
  const char* initial;  // the default, as the docs state it
  const char* when;     // when the library reads it
  const char* what;
};
const SettingInfo& setting_info(Setting setting);
int setting_count();
const SettingInfo& setting_info_at(int index);

// Reads an integer or number setting; `fallback` when unset or empty; throws naming the variable when malformed or
// outside [min_value, max_value].
int64_t env_int(Setting setting, int64_t fallback, int64_t min_value, int64_t max_value);
double env_double(Setting setting, double fallback, double min_value, double max_value);
// The setting's text, or nullptr when it is unset or empty.
const char* env_text(Setting setting);

// TORCH_GEMM_AR_TIMEOUT_S (default 300): bound of every wait on a peer, in seconds.
std::chrono::milliseconds wait_timeout();
// TORCH_GEMM_AR_CHUNKS (default 4): number of M chunks of the `chunked` algorithm.
int64_t chunk_count();

}  // namespace gemm_ar
