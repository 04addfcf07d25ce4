// The order in which one fused call of a group puts its work on the device, free of torch_npu so that the same code
// runs against an emulated stream runtime in the tests (tests/npu_host/sequence_main.cpp). fused_npu.cpp
// instantiates it with the device runtime seam's streams and events (npu/device_runtime.h).
//
// Two rules live here (docs/ascend.md, "Ordering of fused calls" and "Errors"):
//  - Per-group order: a call's kernels start only after the previous fused call of the same group finished on the
//    device, whatever stream or thread queued it. The kernels read the group's device epoch counter when they start
//    and the previous call adds 1 to it when it ends; two calls of one group running at once would share an epoch (and
//    so the tag every flag carries), so each call's flags would satisfy the other's waits (silent corruption, or a
//    cross-rank deadlock).
//  - A failure never shifts a rank's epochs: every call is queued (kernels and the counter increment) before an
//    earlier call's failure is raised, so every rank counts every call, whenever its copy of the error record
//    landed, and the next call on the group works.
//
// Runtime (what the device must offer; fused_npu.cpp wraps the DeviceQueue, the tests emulate it):
//   Stream, Event                  copyable handles; a default Event is "none" (converts to false)
//   Event record(const Stream&)    an event that completes after everything queued on the stream so far
//   void stream_waits_for(const Stream&, const Event&)   the stream runs nothing more until the event completed
//                                  (a device-side wait: the host does not block)
//   void add_epoch(const Stream&)  the group's device epoch counter += 1, queued on the stream
//   bool capturing(const Stream&)  the stream is being captured into a graph
//   void refresh_error_copy(const Stream&)  queues the asynchronous copy of the error record to the host
//   std::string take_landed_failure()       the unreported failure the last landed copy shows, or "" (no waiting)
#pragma once
#include <string>

namespace gemm_ar::npu {

// Where the previous fused call of a group ended on the device. Guarded by the group's mutex.
template <class Event>
struct GroupOrder {
  Event last_join{};
  bool captured = false;  // last_join was recorded while a graph was being captured
};

// Queues one fused call of a group: `launch(caller, comm)` queues the compute kernel on `caller` and the comm
// kernel on `comm` (a signature-only call queues no compute kernel). Returns the failure of an
// earlier call that this rank's landed error record shows ("" if none); the caller raises it, after this returns,
// so the call itself was queued on every rank alike. The caller holds the group's mutex.
template <class Runtime, class Launch>
std::string queue_fused_call(Runtime& rt, GroupOrder<typename Runtime::Event>& order,
                             const typename Runtime::Stream& caller, const typename Runtime::Stream& comm,
                             const Launch& launch) {
  const bool capturing = rt.capturing(caller);
  // Looked at first, raised last: what this rank's copy shows depends on when it landed, which differs by rank.
  std::string earlier = capturing ? std::string() : rt.take_landed_failure();
#if defined(GEMM_AR_TEST_CONTROL_RAISE_BEFORE_LAUNCH)
  if (!earlier.empty()) return earlier;  // test builds only: the rank that saw its copy skips the call
#endif
    // An event recorded outside a capture cannot be waited for inside it (nor the reverse): a capture starts after the
    // device was synchronised, and a replay is ordered by the stream it is replayed on (docs/ascend.md).
#if !defined(GEMM_AR_TEST_CONTROL_NO_GROUP_ORDER)
  if (order.last_join && order.captured == capturing) rt.stream_waits_for(caller, order.last_join);
#endif
  // Fork: the comm kernel starts after everything queued so far on the caller's stream (arguments, scratch, inputs).
  rt.stream_waits_for(comm, rt.record(caller));
  launch(caller, comm);
  // Join: the caller's stream sees the outputs only after the comm kernel wrote them.
  rt.stream_waits_for(caller, rt.record(comm));
  rt.add_epoch(caller);  // after both kernels of this call, before the next call's
  order.last_join = rt.record(caller);
  order.captured = capturing;
  if (!capturing) rt.refresh_error_copy(caller);  // a capture's failures are read by check_errors()
  return earlier;
}

}  // namespace gemm_ar::npu
