// torch_gemm_ar._C_npu: importing it runs the static registrations of this library (the PrivateUse1 kernel of
// pto::gemm_allreduce in npu_op.cpp). Its one function, check_errors(), backs torch_gemm_ar.check_errors() and the
// check at interpreter exit; plain CPython API, so no pybind11.
#include <Python.h>

#include <exception>
#include <string>

#include "npu/sync_points.h"

namespace {

PyObject* check_errors(PyObject* /*self*/, PyObject* /*args*/) {
  std::string failure;
  bool failed = false;
  Py_BEGIN_ALLOW_THREADS  // waits for the device; other Python threads may run meanwhile
      try {
    gemm_ar::npu::check_all_errors();
  } catch (const std::exception& e) {
    failure = e.what();
    failed = true;
  }
  Py_END_ALLOW_THREADS if (failed) {
    PyErr_SetString(PyExc_RuntimeError, failure.c_str());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef npu_methods[] = {
    {"check_errors", check_errors, METH_NOARGS,
     "Waits for the fused NPU kernels queued so far and raises the first failure not reported yet."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef npu_module = {
    PyModuleDef_HEAD_INIT,
    "_C_npu",
    "torch-gemm-ar Ascend NPU backend: the PrivateUse1 kernel of pto::gemm_allreduce",
    -1,           // no per-module state
    npu_methods,  // methods
    nullptr,      // slots
    nullptr,      // traverse
    nullptr,      // clear
    nullptr,      // free
};

}  // namespace

PyMODINIT_FUNC PyInit__C_npu(void) { return PyModule_Create(&npu_module); }
