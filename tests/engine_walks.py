"""For tests of a CPU engine path under both of its ways to reduce a rank's own tiles: the owner-last walk (one
compute thread, communication between tiles) and the comm blocks (a comm thread), forced whatever the host's core
count, over world 2 and 3 and fp32/bf16."""
import pytest
import torch

from scoped_env import scoped_env


def walk_env(owner_last: bool) -> scoped_env:
    """The engine settings of one way; owner_last=False also needs the engine option owner_last=False where comm runs
    inline."""
    return scoped_env(TORCH_GEMM_AR_COMPUTE_THREADS="1", TORCH_GEMM_AR_COMM_THREADS="0" if owner_last else "1")


def engine_grid(test):
    """Parametrizes `test` over world (2, 3), dtype (fp32, bf16) and owner_last (the walk, the comm blocks)."""
    test = pytest.mark.parametrize("owner_last", [True, False], ids=["owner_last", "comm_blocks"])(test)
    test = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)(test)
    return pytest.mark.parametrize("world", [2, 3])(test)
