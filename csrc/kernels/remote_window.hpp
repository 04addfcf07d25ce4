// Remote-address translation over HCCL's symmetric windows (docs/architecture.md §3.4;
// docs/decisions/0013-npu-hccl-windows-and-setup.md): every rank carves the same regions at the same offsets, so a
// peer's copy of a local window address is windows_in[peer] + (local - windows_in[me]). Our region starts window_offset
// bytes into each window.
#pragma once
#include "device_support.hpp"

namespace gemm_ar {
namespace device {

class RemoteWindows {
 public:
  // Reads the window bases of all ranks from the device context once; false when the context does not describe
  // the group the host said it does (wrong rank or world).
  AICORE inline bool init(const KernelArgs& args) {
    __gm__ CommContext* ctx = reinterpret_cast<__gm__ CommContext*>(args.comm_ctx);
    if (site_kept(kControlContextStale)) invalidate_lines(ctx, static_cast<int64_t>(sizeof(CommContext)));
    me_ = args.rank;
    world_ = args.world;
    if (static_cast<int32_t>(scalar_load(&ctx->rank_id)) != me_ ||
        static_cast<int32_t>(scalar_load(&ctx->rank_num)) != world_) {
      return false;
    }
    const uint64_t win_size = scalar_load(&ctx->win_size);
    if (win_size != 0 && args.window_offset + args.window_bytes > win_size) return false;
    for (int32_t r = 0; r < world_; ++r) {
      const uint64_t base = scalar_load(&ctx->windows_in[r]);
      if (base == 0) return false;
      base_[r] = base + args.window_offset;
    }
    return true;
  }

  // Address of byte `offset` of our region in rank `peer`'s window.
  template <typename T>
  AICORE inline __gm__ T* at(int32_t peer, int64_t offset) const {
    return gm_at<T>(base_[peer], offset);
  }

  template <typename T>
  AICORE inline __gm__ T* local(int64_t offset) const {
    return at<T>(me_, offset);
  }

  // The peer's copy of a local window address.
  template <typename T>
  AICORE inline __gm__ T* remote(__gm__ T* local_ptr, int32_t peer) const {
    const uint64_t offset = reinterpret_cast<uint64_t>(local_ptr) - base_[me_];
    return reinterpret_cast<__gm__ T*>(base_[peer] + offset);
  }

  AICORE inline int32_t me() const { return me_; }
  AICORE inline int32_t world() const { return world_; }

 private:
  uint64_t base_[kMaxWorld];
  int32_t me_ = 0;
  int32_t world_ = 1;
};

}  // namespace device
}  // namespace gemm_ar
