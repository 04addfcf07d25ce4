"""Builds torch_gemm_ar._C (CPU engine, portable algorithms, op registration) everywhere, and the Ascend NPU
pieces only where CANN and torch_npu are found (see build_npu.py)."""
import glob
import os
import sys

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
VERSION = "0.1.0"
sys.path.insert(0, ROOT)  # PEP 517 builds do not put the project directory on sys.path

import build_npu  # noqa: E402


def _rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


cpu_extension = CppExtension(
    "torch_gemm_ar._C",
    sources=_rel("csrc/host/*.cpp") + _rel("csrc/host/common/*.cpp") + _rel("csrc/host/cpu/*.cpp"),
    include_dirs=[os.path.join(ROOT, "csrc/include"), os.path.join(ROOT, "csrc/host")],
    # No -march=native: the wheel must run on any x86-64 with AVX2 (no AVX-512 SIGILL on older hosts).
    extra_compile_args=["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    libraries=["rt"],
    define_macros=[("TORCH_GEMM_AR_VERSION", f'"{VERSION}"')],  # the auto tuner's cache is per library version
)

setup(
    name="torch-gemm-ar",
    version=VERSION,
    description="Fused GEMM + AllReduce for tensor-parallel PyTorch (Ascend NPU and CPU)",
    packages=find_packages(include=["torch_gemm_ar", "torch_gemm_ar.*"]),
    package_data={"torch_gemm_ar": ["libgemm_ar_*.so"]},  # the Ascend kernels, where they were built
    python_requires=">=3.9",
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        # transformers/accelerate: tests/test_hf_tp.py and examples/hf_llama_tp.py (5.24 is the version verified).
        "test": ["pytest>=7", "pytest-timeout", "matplotlib", "transformers>=5.24", "accelerate>=1.15"],
        "bench": ["matplotlib"],
        "npu": ["torch_npu"],
    },
    ext_modules=[cpu_extension] + build_npu.npu_extensions(ROOT),
    cmdclass={"build_ext": BuildExtension},
    zip_safe=False,
)
