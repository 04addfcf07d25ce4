// What every comm kernel's block does around its op's own work (gemm_comm_kernel.cpp, sp_comm_kernel.cpp): attach
// to the device context, agree with every peer on the call signature before any data moves (call_signature.hpp),
// and store NaN over `out` when the call fails; plus the UB staging map and subtile type both kernels move data
// with. agree() is the line no remote write may cross early: before it a block writes only into its own rank's
// window, since a peer's window may still be HCCL's until that peer's signature of this call is seen there.
//
// An op's block derives from CommBlockBase and adds init_call() (its plan-dependent state), prepare(), run() (false:
// the call failed, recorded) and poison() (NaN over its `out`, through poison_rows); run_comm_block() calls them in
// the one order every comm kernel follows.
#pragma once
#include <pto/pto-inst.hpp>

#include "call_signature.hpp"
#include "device_support.hpp"
#include "remote_window.hpp"

namespace gemm_ar {
namespace device {

// One subtile (sub_m x base_n at most) in UB.
template <typename T>
using SubTile = pto::Tile<pto::TileType::Vec, T, kSubM, kBaseN, pto::BLayout::RowMajor, pto::DYNAMIC, pto::DYNAMIC>;

constexpr uint32_t kUbSubtileBytes = kSubM * kBaseN * 2;
constexpr uint32_t kUbMove = 0;                           // every copy's staging (and the poison's NaNs)
constexpr uint32_t kUbZeros = kUbMove + kUbSubtileBytes;  // a subtile of zeros (prepare)
static_assert(kUbZeros + kUbSubtileBytes <= 192 * 1024, "UB overflow");

class CommBlockBase {
 public:
  AICORE inline CommBlockBase(const KernelArgs& args, int64_t block) : args_(args), c_(block) {}

  // False (error already recorded) when the device context does not match the arguments.
  AICORE inline bool attach() {
    if (!win_.init(args_)) {
      report_error(args_, kErrBadArgs, -1, -1, static_cast<int32_t>(c_), 1);
      return false;
    }
    me_ = args_.rank;
    world_ = args_.world;
    tag_ = signal_tag(args_.epoch);
    tag_high_ = signal_tag_high(args_.epoch);
    return true;
  }

  // `usable`: this kernel found its own arguments usable; if not, it says so in word 0 of its signature so that
  // every rank stops. False (error recorded unless another block of this rank failed first) on any difference.
  // True: every peer's comm kernel has started this call, so this block may write into their windows from now on.
  AICORE inline bool agree(bool usable) {
    int64_t mine[kSignatureWords];
    for (int64_t w = 0; w < kSignatureWords; ++w) mine[w] = args_.signature[w];
    if (!usable && args_.signature_only == 0 && mine[0] == 0) mine[0] = kSignatureKernelRejected;
    if (c_ == 0) publish_signature(win_, args_, mine);
    const SignatureVerdict verdict = check_signatures(win_, args_, mine);
    if (verdict.code == kErrNone) return true;
    if (verdict.code != kErrAborted) {
      report_error(args_, verdict.code, verdict.peer, verdict.item, static_cast<int32_t>(c_), 1);
    }
    return false;
  }

 protected:
  // NaN over rows [0, rows) x [0, n) of `out`. Called by a block that gives up, after its own last store to `out`,
  // so whatever it wrote before is overwritten too.
  template <typename T>
  AICORE inline void poison_rows(int64_t rows) {
    if (args_.out == 0) return;
    pipe_barrier(PIPE_ALL);  // nothing of this block may still be using the staging UB
    SubTile<T> nans(kSubM, kBaseN);
    TASSIGN(nans, kUbMove);
    TEXPANDS(nans, static_cast<T>(__builtin_nanf("")));
    set_event(PIPE_V, PIPE_MTE3, EVENT_ID0);
    wait_event(PIPE_V, PIPE_MTE3, EVENT_ID0);
    const int64_t n = args_.plan.n;
    for (int64_t r0 = 0; r0 < rows; r0 += kSubM) {
      for (int64_t c0 = 0; c0 < n; c0 += kBaseN) {
        const int64_t h = rows - r0 < kSubM ? rows - r0 : kSubM;
        const int64_t w = n - c0 < kBaseN ? n - c0 : kBaseN;
        SubTile<T> view(static_cast<unsigned>(h), static_cast<unsigned>(w));
        TASSIGN(view, kUbMove);
        auto out = nd_view<T>(gm_at<T>(args_.out, 0) + r0 * args_.ldo + c0, h, w, args_.ldo);
        store_tile(out, view);
      }
    }
    pipe_barrier(PIPE_ALL);
  }

  const KernelArgs& args_;
  const int64_t c_;
  RemoteWindows win_;
  int32_t me_ = 0;
  int32_t world_ = 1;
  uint32_t tag_ = 0;
  uint32_t tag_high_ = 0;
};

// One comm block's whole call. `usable`: kernel_args_usable() passed (a signature-only call never moves data and
// has nothing to poison).
template <typename Block>
AICORE inline void run_comm_block(Block& comm, bool usable) {
  if (!comm.attach()) {
    if (usable) comm.poison();  // the device context does not match: no result will come
    return;
  }
  if (!comm.agree(usable)) {
    if (usable) comm.poison();
    return;
  }
  if (!usable) return;  // signature-only call, agreed: nothing to move
  comm.init_call();
  comm.prepare();
  if (!comm.run()) comm.poison();
}

}  // namespace device
}  // namespace gemm_ar
