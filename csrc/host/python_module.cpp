// torch_gemm_ar._C: loading it registers the op (static initialisers of ops.cpp and the device kernels).
#include <torch/extension.h>

namespace gemm_ar { void bind_protocol(pybind11::module_& m); }  // csrc/host/protocol_bindings.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch-gemm-ar native extension: pto::gemm_allreduce and its engines";
  gemm_ar::bind_protocol(m);
}
