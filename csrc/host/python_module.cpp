// torch_gemm_ar._C: loading it registers the op (static initialisers of ops.cpp and the device kernels).
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch-gemm-ar native extension: pto::gemm_allreduce and its engines";
}
