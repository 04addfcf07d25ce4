// torch_gemm_ar._C_npu: importing it runs the static registrations of this library (the PrivateUse1 kernel of
// pto::gemm_allreduce in npu_op.cpp). It exposes nothing else, so it needs no pybind11.
#include <Python.h>

namespace {

PyModuleDef npu_module = {
    PyModuleDef_HEAD_INIT,
    "_C_npu",
    "torch-gemm-ar Ascend NPU backend: the PrivateUse1 kernel of pto::gemm_allreduce",
    -1,       // no per-module state
    nullptr,  // methods
    nullptr,  // slots
    nullptr,  // traverse
    nullptr,  // clear
    nullptr,  // free
};

}  // namespace

PyMODINIT_FUNC PyInit__C_npu(void) { return PyModule_Create(&npu_module); }
