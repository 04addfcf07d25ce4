// torch_gemm_ar._C: loading it registers the op (static initialisers of ops.cpp and the device kernels).
#include <torch/extension.h>

#include "cpu/fused_call.h"

namespace gemm_ar { void bind_protocol(pybind11::module_& m); }  // csrc/host/protocol_bindings.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch-gemm-ar native extension: pto::gemm_allreduce and its engines";
  gemm_ar::bind_protocol(m);
  auto& switches = gemm_ar::cpu::engine_switches();
  m.def("_set_fused_overlap", [&switches](bool on) { return switches.overlap.exchange(on); },
        "CPU fused engine: False runs communication only after the whole GEMM (benchmarks); returns the old value");
  m.def("_set_ignore_epochs", [&switches](bool on) { return switches.ignore_epochs.exchange(on); },
        "CPU fused engine: a deliberate protocol bug for negative-control tests (stale flags count as ready)");
}
