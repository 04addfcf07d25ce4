// gemm_ar_emu: the emulated runtime's controls for the tests (docs/decisions/0019-emulated-npu-runtime.md), in the
// same shared object as the emulated torch_gemm_ar._C_npu: its communicator for c10d, its streams, and what the
// simulator's cache model counted.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/extension.h>

#include "emu_graph.h"
#include "emu_hccl.h"
#include "emu_settings.h"
#include "emu_streams.h"
#include "sim_kernels.h"

namespace py = pybind11;

PYBIND11_MODULE(gemm_ar_emu, m) {
  py::module_::import("torch.distributed");  // registers c10d's Backend and Store with pybind11
  py::class_<gemm_ar::emu::EmulatedHccl, c10d::Backend, c10::intrusive_ptr<gemm_ar::emu::EmulatedHccl>>(m,
                                                                                                        "EmulatedHccl");
  m.def(
      "make_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
         const c10::intrusive_ptr<c10d::Backend>& gloo,
         bool mesh) { return c10::make_intrusive<gemm_ar::emu::EmulatedHccl>(store, rank, size, gloo, mesh); },
      "The emulated HCCL backend of one group, running its collectives with `gloo` on CPU aliases; `mesh`: the "
      "topology it reports (False: RING).");
  m.def(
      "new_stream", [] { return gemm_ar::emu::new_stream().id(); }, "A new emulated stream's id.");
  m.def(
      "set_stream", [](int64_t id) { gemm_ar::emu::set_current_stream_id(id); },
      "Makes stream `id` the calling thread's current stream.");
  m.def(
      "current_stream", [] { return gemm_ar::emu::current_stream_id(); }, "The calling thread's current stream.");
  m.def(
      "synchronize", [] { gemm_ar::emu::synchronize_all(); }, py::call_guard<py::gil_scoped_release>(),
      "Waits for every stream (bounded) and raises a device error.");
  py::class_<gemm_ar::emu::Graph, std::shared_ptr<gemm_ar::emu::Graph>>(m, "Graph")
      .def(
          "replay", [](const gemm_ar::emu::Graph& g) { g.replay(gemm_ar::emu::current_stream_id()); },
          "Queues the captured work again on the current stream (and the streams that joined the capture).")
      .def("launches", &gemm_ar::emu::Graph::launches, "How many kernel launches the graph holds.");
  m.def(
      "begin_capture", [] { gemm_ar::emu::begin_capture(gemm_ar::emu::current_stream_id()); },
      "Starts capturing the current stream into a graph.");
  m.def(
      "end_capture", [] { return gemm_ar::emu::end_capture(gemm_ar::emu::current_stream_id()); },
      "Ends the current stream's capture: the graph.");
  m.def(
      "capturing", [] { return gemm_ar::emu::stream(gemm_ar::emu::current_stream_id()).capturing(); },
      "Whether the current stream is being captured.");
  m.def(
      "host_synchronisations", [] { return gemm_ar::emu::host_synchronisations(); },
      "How many host synchronisations the host code asked for so far (DeviceControl's waits, c10d collectives).");
  m.def(
      "drop_next_launches", [](int64_t count) { gemm_ar::emu::drop_next_launches(count); },
      "Negative control: the next `count` kernel launches of this process never run.");
  m.def(
      "replays_skip_counter", [](bool skip) { gemm_ar::emu::set_replays_skip_counter(skip); },
      "Negative control: replayed epoch counter increments do nothing (every replay reuses the capture's epoch).");
  m.def(
      "overlapping_kernels", [] { return gemm_ar::emu::overlapping_kernels(); },
      "How many kernels started while a kernel of another call of the same communicator ran, in this process.");
  m.def(
      "contexts_built",
      [] {
        py::dict d;
        d["mesh"] = gemm_ar::emu::contexts_built(true);
        d["ring"] = gemm_ar::emu::contexts_built(false);
        return d;
      },
      "How many MESH contexts and RING op-resource blocks the emulated HCCL built in this process.");
  m.def(
      "model_counters",
      [] {
        const auto c = gemm_ar::emu::sim::model_counters();
        py::dict d;
        d["lost_store_lines"] = c.lost_store_lines;
        d["unfenced_flags"] = c.unfenced_flags;
        d["unfenced_accesses"] = c.unfenced_accesses;
        d["sync_waits_without_set"] = c.sync_waits_without_set;
        d["sync_sets_unwaited"] = c.sync_sets_unwaited;
        return d;
      },
      "What the simulator's cache and ordering model counted in this process.");
  m.def(
      "check_settings", [] { gemm_ar::emu::settings::check_all(); },
      "Reads every GEMM_AR_EMU_* setting (and HCCL_BUFFSIZE): raises naming one the emulator cannot take.");
  m.def("bf16_native", &gemm_ar::emu::sim::bf16_native, "Whether the simulator stores bfloat16 natively.");
}
