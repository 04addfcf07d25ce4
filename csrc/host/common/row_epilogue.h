// The epilogue a fused op runs on its output row block by row block (add+RMSNorm): `epilogue(out, row0, rows)` is
// called exactly once for every row of the [M, N] row-major output `out`, once those rows are final on this rank
// (on the CPU engine by the comm block that made a block's last subtile final, while the rows are still in cache).
#pragma once
#include <cstdint>
#include <functional>

namespace gemm_ar {

using RowEpilogue = std::function<void(void* out, int64_t row0, int64_t rows)>;

}  // namespace gemm_ar
