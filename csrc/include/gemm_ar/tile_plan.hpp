// How the padded M x N output is cut into base_m x base_n tiles, each tile into sub_m-row stripes (subtiles),
// and how K is stepped (docs/architecture.md §3.1). Shapes are runtime values.
#pragma once
#include <cstdint>

#include "fn.hpp"

namespace gemm_ar {

struct TilePlan {
  int64_t m, n, k;                  // logical problem sizes
  int64_t base_m, base_n, base_k;   // tile sizes
  int64_t k_step;                   // base_k * k_slices: K consumed per L1 load
  int64_t m_tiles, n_tiles, tiles;  // tile grid; tiles = m_tiles * n_tiles (0 when m or n is 0)
  int64_t pad_m, pad_n, pad_k;      // m_tiles*base_m, n_tiles*base_n, k rounded up to k_step
  int64_t sub_m;                    // rows per subtile (stripe)
  int64_t stripes;                  // base_m / sub_m
};

// Largest int64_t, spelled out so device builds do not depend on the INT64_MAX macro.
constexpr int64_t kInt64Max = 0x7fffffffffffffffLL;

// Ceil division for a >= 0, b > 0.
GEMM_AR_FN int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// a * b without overflow for a, b >= 0; false when the product would not fit in int64_t.
GEMM_AR_FN bool checked_mul(int64_t a, int64_t b, int64_t* out) {
  if (a != 0 && b > kInt64Max / a) return false;
  *out = a * b;
  return true;
}

// Fills *plan; false (plan untouched) for non-positive bases/k_slices/sub_m, sub_m not dividing base_m,
// negative sizes, or padded sizes whose byte counts (up to 8 bytes an element) would overflow int64.
GEMM_AR_FN bool make_tile_plan(TilePlan* plan, int64_t m, int64_t n, int64_t k, int64_t base_m, int64_t base_n,
                               int64_t base_k, int64_t k_slices, int64_t sub_m) {
  if (plan == nullptr) return false;
  if (m < 0 || n < 0 || k < 0) return false;
  if (base_m <= 0 || base_n <= 0 || base_k <= 0 || k_slices <= 0 || sub_m <= 0) return false;
  if (base_m % sub_m != 0) return false;
  int64_t k_step = 0;
  if (!checked_mul(base_k, k_slices, &k_step)) return false;
  // Keep the round-ups below from overflowing.
  if (m > kInt64Max - base_m || n > kInt64Max - base_n || k > kInt64Max - k_step) return false;
  const int64_t m_tiles = ceil_div(m, base_m);
  const int64_t n_tiles = ceil_div(n, base_n);
  const int64_t pad_m = m_tiles * base_m;
  const int64_t pad_n = n_tiles * base_n;
  const int64_t pad_k = ceil_div(k, k_step) * k_step;
  int64_t elems = 0, bytes = 0, pad_mk = 0, pad_kn = 0;
  if (!checked_mul(pad_m, pad_n, &elems) || !checked_mul(elems, 8, &bytes)) return false;
  if (!checked_mul(pad_m, pad_k, &pad_mk) || !checked_mul(pad_mk, 8, &bytes)) return false;
  if (!checked_mul(pad_k, pad_n, &pad_kn) || !checked_mul(pad_kn, 8, &bytes)) return false;
  plan->m = m;
  plan->n = n;
  plan->k = k;
  plan->base_m = base_m;
  plan->base_n = base_n;
  plan->base_k = base_k;
  plan->k_step = k_step;
  plan->m_tiles = m_tiles;
  plan->n_tiles = n_tiles;
  plan->tiles = m_tiles * n_tiles;
  plan->pad_m = pad_m;
  plan->pad_n = pad_n;
  plan->pad_k = pad_k;
  plan->sub_m = sub_m;
  plan->stripes = base_m / sub_m;
  return true;
}

// Tile id t = mi * n_tiles + ni. Accessors come with a reference and a pointer overload so that either
// calling style compiles.
GEMM_AR_FN int64_t tile_row(const TilePlan& plan, int64_t t) { return t / plan.n_tiles; }
GEMM_AR_FN int64_t tile_col(const TilePlan& plan, int64_t t) { return t % plan.n_tiles; }

// Valid (unpadded) rows of tile row mi: base_m except in the tail row; 0 outside the grid.
GEMM_AR_FN int64_t tile_rows(const TilePlan& plan, int64_t mi) {
  const int64_t left = plan.m - mi * plan.base_m;
  if (mi < 0 || left <= 0) return 0;
  return left < plan.base_m ? left : plan.base_m;
}

// Valid (unpadded) columns of tile column ni.
GEMM_AR_FN int64_t tile_cols(const TilePlan& plan, int64_t ni) {
  const int64_t left = plan.n - ni * plan.base_n;
  if (ni < 0 || left <= 0) return 0;
  return left < plan.base_n ? left : plan.base_n;
}

// Valid rows of stripe `stripe` in tile row mi; 0 when the stripe lies wholly in the padding.
GEMM_AR_FN int64_t stripe_rows(const TilePlan& plan, int64_t mi, int64_t stripe) {
  if (stripe < 0 || stripe >= plan.stripes) return 0;
  const int64_t left = tile_rows(plan, mi) - stripe * plan.sub_m;
  if (left <= 0) return 0;
  return left < plan.sub_m ? left : plan.sub_m;
}

GEMM_AR_FN int64_t tile_row(const TilePlan* plan, int64_t t) { return tile_row(*plan, t); }
GEMM_AR_FN int64_t tile_col(const TilePlan* plan, int64_t t) { return tile_col(*plan, t); }
GEMM_AR_FN int64_t tile_rows(const TilePlan* plan, int64_t mi) { return tile_rows(*plan, mi); }
GEMM_AR_FN int64_t tile_cols(const TilePlan* plan, int64_t ni) { return tile_cols(*plan, ni); }
GEMM_AR_FN int64_t stripe_rows(const TilePlan* plan, int64_t mi, int64_t stripe) {
  return stripe_rows(*plan, mi, stripe);
}

}  // namespace gemm_ar
