// Stand-in for pto-isa's <pto/pto-inst.hpp> in tests/test_kernels_device_build.py's C++17 build only: pto-isa's
// CPU simulator headers need C++20 (its README says so), the device compiler sees the kernels as C++17. Declares
// just what csrc/kernels uses, with the same template parameter kinds, so the kernels' own code is checked as
// C++17 by g++ and clang++. Tile instructions do nothing: objects built this way are compiled and never run, except
// for tests/kernels_sim/args_load_check.cpp, which uses no tile instruction.
#pragma once
#include <cstddef>
#include <cstdint>

#define AICORE
#define __aicore__
#define __global__
#define __gm__

// The device's 16-bit float types: storage only here (the kernels merely convert a float into them).
struct half {
  uint16_t bits = 0;
  half() = default;
  explicit half(float) {}
};
struct bfloat16_t {
  uint16_t bits = 0;
  bfloat16_t() = default;
  explicit bfloat16_t(float) {}
};

enum pipe_t { PIPE_S, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_FIX, PIPE_ALL };
enum event_t { EVENT_ID0, EVENT_ID1, EVENT_ID2, EVENT_ID3, EVENT_ID4, EVENT_ID5, EVENT_ID6, EVENT_ID7 };
enum mem_dsb_t { DSB_ALL, DSB_DDR, DSB_UB, DSB_SEQ };
struct cache_line_t {
  static constexpr int SINGLE_CACHE_LINE = 0;
  static constexpr int ENTIRE_DATA_CACHE = 1;
};

// Core ordering: no-ops on a CPU, where the test build compiles them only.
inline void pipe_barrier(pipe_t) {}
inline void set_flag(pipe_t, pipe_t, event_t) {}
inline void wait_flag(pipe_t, pipe_t, event_t) {}
inline void dsb(mem_dsb_t) {}
inline void dcci(const volatile void*, int) {}
inline int64_t get_block_idx() { return 0; }
inline int64_t get_block_num() { return 1; }
inline int64_t get_sys_cnt() { return 0; }

namespace pto {

constexpr int DYNAMIC = -1;
constexpr uint32_t TMP_UB_OFFSET = 184 * 1024;

enum class TileType { Vec, Mat, Left, Right, Acc, Bias };
enum class BLayout { RowMajor, ColMajor };
enum class SLayout { NoneBox, RowMajor, ColMajor };
enum class Layout { ND, DN, NZ };
enum class RoundMode : uint8_t { CAST_NONE, CAST_RINT };
enum class AtomicType : uint8_t { AtomicNone, AtomicAdd };

template <TileType Loc, typename Element, int Rows, int Cols, BLayout Outer = BLayout::RowMajor, int RowValid = Rows,
          int ColValid = Cols, SLayout Inner = SLayout::NoneBox, int FractalBytes = 512>
struct Tile {
  using DType = Element;
  Tile() = default;
  Tile(size_t rows, size_t cols) : valid_rows(rows), valid_cols(cols) {}
  size_t valid_rows = RowValid > 0 ? RowValid : 0;
  size_t valid_cols = ColValid > 0 ? ColValid : 0;
  uint64_t address = 0;
};
template <typename Element, int Rows, int Cols, int RowValid = Rows, int ColValid = Cols>
using TileLeft = Tile<TileType::Left, Element, Rows, Cols, BLayout::ColMajor, RowValid, ColValid, SLayout::RowMajor>;
template <typename Element, int Rows, int Cols, int RowValid = Rows, int ColValid = Cols>
using TileRight = Tile<TileType::Right, Element, Rows, Cols, BLayout::RowMajor, RowValid, ColValid, SLayout::ColMajor>;
template <typename Element, int Rows, int Cols, int RowValid = Rows, int ColValid = Cols>
using TileAcc = Tile<TileType::Acc, Element, Rows, Cols, BLayout::ColMajor, RowValid, ColValid, SLayout::RowMajor>;

template <int64_t N1 = DYNAMIC, int64_t N2 = DYNAMIC, int64_t N3 = DYNAMIC, int64_t N4 = DYNAMIC, int64_t N5 = DYNAMIC>
struct Shape {
  Shape(int64_t a, int64_t b, int64_t c, int64_t d, int64_t e) : dims{a, b, c, d, e} {}
  int64_t dims[5];
};
template <int64_t N1 = DYNAMIC, int64_t N2 = DYNAMIC, int64_t N3 = DYNAMIC, int64_t N4 = DYNAMIC, int64_t N5 = DYNAMIC>
struct Stride {
  Stride(int64_t a, int64_t b, int64_t c, int64_t d, int64_t e) : steps{a, b, c, d, e} {}
  int64_t steps[5];
};
template <typename Element, typename ShapeT, typename StrideT, Layout L = Layout::ND>
struct GlobalTensor {
  GlobalTensor(Element* data, const ShapeT& shape, const StrideT& stride) : ptr(data), shape(shape), stride(stride) {}
  Element* ptr;
  ShapeT shape;
  StrideT stride;
};

}  // namespace pto

// The tile instructions the kernels use, by argument kind only.
template <typename TileT>
inline void TASSIGN(TileT& tile, uint64_t address) {
  tile.address = address;
}
template <typename TileT, typename GmT>
inline void TLOAD(TileT&, GmT&) {}
template <typename TileT, typename GmT, pto::AtomicType Atomic = pto::AtomicType::AtomicNone>
inline void TSTORE(GmT&, TileT&) {}
template <typename Dst, typename Src>
inline void TEXTRACT(Dst&, Src&, uint16_t, uint16_t) {}
template <typename Dst, typename Src>
inline void TMOV(Dst&, Src&) {}
template <typename Acc, typename L, typename R>
inline void TMATMUL(Acc&, L&, R&) {}
template <typename Acc, typename L, typename R>
inline void TMATMUL_ACC(Acc&, Acc&, L&, R&) {}
template <typename Acc, typename L, typename R, typename Bias>
inline void TMATMUL_BIAS(Acc&, L&, R&, Bias&) {}
template <typename Dst, typename Src>
inline void TCVT(Dst&, Src&, pto::RoundMode) {}
template <typename Dst, typename Scalar>
inline void TEXPANDS(Dst&, Scalar) {}
template <typename Dst, typename A, typename B>
inline void TADD(Dst&, A&, B&) {}
template <typename Dst, typename A, typename B>
inline void TMUL(Dst&, A&, B&) {}
template <typename Dst, typename Src>
inline void TADDS(Dst&, Src&, float) {}
template <typename Dst, typename Src>
inline void TMULS(Dst&, Src&, float) {}
template <typename Dst, typename Src, typename Tmp>
inline void TROWSUM(Dst&, Src&, Tmp&) {}
template <typename Dst, typename Src>
inline void TROWEXPAND(Dst&, Src&) {}
template <typename Dst, typename A, typename B>
inline void TROWEXPANDMUL(Dst&, A&, B&) {}
template <typename Dst, typename A, typename B>
inline void TCOLEXPANDMUL(Dst&, A&, B&) {}
template <typename Dst, typename Src, typename Tmp>
inline void TRSQRT(Dst&, Src&, Tmp&) {}
template <typename Dst, typename Src>
inline void TRECIP(Dst&, Src&) {}
