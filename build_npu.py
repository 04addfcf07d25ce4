"""Decides whether the Ascend NPU pieces can be built on this machine and describes how to build them."""
import os
import shutil


def cann_missing_reason():
    """Why the NPU build cannot run here, or None when CANN (bisheng) and torch_npu are all present."""
    if not os.environ.get("ASCEND_HOME_PATH"):
        return "ASCEND_HOME_PATH is not set"
    if shutil.which("bisheng") is None:
        return "bisheng is not on PATH"
    try:
        import importlib.util

        if importlib.util.find_spec("torch_npu") is None:
            return "torch_npu is not installed"
    except ImportError:
        return "torch_npu is not installed"
    return None


def npu_extensions(root):
    reason = cann_missing_reason()
    if reason is not None:
        print(f"torch-gemm-ar: skipping the Ascend NPU backend ({reason}); building the CPU extension only")
        return []
    raise RuntimeError("torch-gemm-ar: the Ascend NPU build is not implemented yet")
