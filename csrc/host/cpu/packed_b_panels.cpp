#include "cpu/packed_b_panels.h"

#include <dlfcn.h>
#include <gemm_ar/tile_plan.hpp>

#include <atomic>
#include <climits>
#include <cstdint>

#include "common/settings.h"
#include "cpu/output_pool.h"

namespace gemm_ar::cpu {
namespace {

// oneMKL's CBLAS constants (mkl_cblas.h) and its LP64 entry points (MKL_INT = int).
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;
using PackGetSize = size_t (*)(int identifier, int m, int n, int k);
using Pack = void (*)(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src, int ld,
                      float* dest);
using Compute = void (*)(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc);

struct PackedGemmApi {
  PackGetSize get_size = nullptr;
  Pack pack = nullptr;
  Compute compute = nullptr;
  bool found() const { return get_size != nullptr && pack != nullptr && compute != nullptr; }
};

// The library holding torch's BLAS is already loaded (RTLD_NOLOAD: never loads anything); builds of torch without
// oneMKL (other CPUs, other BLAS) simply do not have the symbols.
const PackedGemmApi& packed_gemm_api() {
  static const PackedGemmApi api = [] {
    PackedGemmApi found;
    void* torch_cpu = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    if (torch_cpu == nullptr) return found;
    found.get_size = reinterpret_cast<PackGetSize>(dlsym(torch_cpu, "cblas_sgemm_pack_get_size"));
    found.pack = reinterpret_cast<Pack>(dlsym(torch_cpu, "cblas_sgemm_pack"));
    found.compute = reinterpret_cast<Compute>(dlsym(torch_cpu, "cblas_sgemm_compute"));
    return found;
  }();
  return api;
}

std::atomic<int64_t> panels_packed{0};

bool fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

}  // namespace

bool packed_b_gemm_available() { return packed_gemm_api().found(); }

int64_t packed_b_panel_count() { return panels_packed.load(std::memory_order_relaxed); }

PackedBPanels::PackedBPanels(const at::Tensor& b, int64_t panel_cols, int64_t tile_rows)
    : b_(b), panel_cols_(panel_cols), tile_rows_(tile_rows) {
  const auto& api = packed_gemm_api();
  if (!api.found() || b.scalar_type() != at::kFloat || b.dim() != 2 || !b.is_cpu()) return;
  k_ = b.size(0);
  n_ = b.size(1);
  // A B under 16K elements stays with at::mm: re-packing it per tile costs next to nothing, and a packed buffer of
  // a new size per call would only churn the output pool (RSS grew through 40,000 random tiny calls).
  constexpr int64_t kMinElements = 16384;
  if (k_ * n_ < kMinElements || panel_cols <= 0 || tile_rows <= 0) return;
  // Row-major [K, N] with unit column stride, or the transpose of one (a weight's .t()).
  if (b.stride(1) == 1 && b.stride(0) >= n_) {
    transposed_ = false;
  } else if (b.stride(0) == 1 && b.stride(1) >= k_) {
    transposed_ = true;
  } else {
    return;
  }
  if (!fits_int(k_) || !fits_int(n_) || !fits_int(tile_rows) || !fits_int(std::max(b.stride(0), b.stride(1)))) return;
  const int64_t panels = ceil_div(n_, panel_cols);
  int64_t total = 0;
  for (int64_t p = 0; p < panels; ++p) {
    offsets_.push_back(total);
    const int64_t cols = std::min(panel_cols, n_ - p * panel_cols);
    const size_t bytes =
        api.get_size(kBMatrix, static_cast<int>(tile_rows), static_cast<int>(cols), static_cast<int>(k_));
    if (bytes == 0) return;
    total += ceil_div(static_cast<int64_t>(bytes), 64) * 64;  // each panel 64-byte aligned
  }
  // The packed panels live for the whole call (about twice b's bytes): large weights keep at::mm.
  if (total > env_int(Setting::kPackedBMaxMb, 256, 0, 1 << 20) * (int64_t{1} << 20)) return;
  storage_ = pooled_empty(1, total / 4 + 16, at::kFloat);  // + 64 bytes to align the base
  packed_.reset(new std::once_flag[panels]);
  usable_ = true;
}

uint8_t* PackedBPanels::panel_base(int64_t panel) const {
  const auto base = (reinterpret_cast<uintptr_t>(storage_.data_ptr()) + 63) & ~uintptr_t{63};
  return reinterpret_cast<uint8_t*>(base) + offsets_[panel];
}

void PackedBPanels::pack(int64_t panel) const {
  const int64_t col0 = panel * panel_cols_, cols = std::min(panel_cols_, n_ - col0);
  const float* src = b_.const_data_ptr<float>();
  // A panel of columns of b: columns col0.. of a row-major [K, N], or rows col0.. of the row-major [N, K] it
  // transposes.
  const int ld = static_cast<int>(transposed_ ? b_.stride(1) : b_.stride(0));
  src += transposed_ ? col0 * b_.stride(1) : col0;
  packed_gemm_api().pack(kRowMajor, kBMatrix, transposed_ ? kTrans : kNoTrans, static_cast<int>(tile_rows_),
                         static_cast<int>(cols), static_cast<int>(k_), 1.0f, src, ld,
                         reinterpret_cast<float*>(panel_base(panel)));
  panels_packed.fetch_add(1, std::memory_order_relaxed);
}

bool PackedBPanels::multiply(const at::Tensor& a_rows, int64_t col0, int64_t cols, at::Tensor& out,
                             bool accumulate) const {
  if (!usable_ || col0 % panel_cols_ != 0 || cols != std::min(panel_cols_, n_ - col0)) return false;
  const int64_t rows = a_rows.size(0);
  // Row-major operands as BLAS takes them: lda >= k and ldc >= cols (an expanded or single-row view of a may have
  // any row stride, which at::mm copes with and the packed GEMM would refuse without writing out).
  if (rows > tile_rows_ || a_rows.scalar_type() != at::kFloat || a_rows.size(1) != k_ || a_rows.stride(1) != 1 ||
      a_rows.stride(0) < k_ || !fits_int(a_rows.stride(0)) || out.scalar_type() != at::kFloat || out.stride(1) != 1 ||
      out.stride(0) < cols || !fits_int(out.stride(0)) || out.size(0) != rows || out.size(1) != cols) {
    return false;
  }
  if (rows == 0) return true;
  const int64_t panel = col0 / panel_cols_;
  std::call_once(packed_[panel], [&] { pack(panel); });
  packed_gemm_api().compute(kRowMajor, kNoTrans, kPacked, static_cast<int>(rows), static_cast<int>(cols),
                            static_cast<int>(k_), a_rows.const_data_ptr<float>(), static_cast<int>(a_rows.stride(0)),
                            reinterpret_cast<const float*>(panel_base(panel)), static_cast<int>(cols),
                            accumulate ? 1.0f : 0.0f, out.data_ptr<float>(), static_cast<int>(out.stride(0)));
  return true;
}

}  // namespace gemm_ar::cpu
