import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rank_pool import RankPool  # noqa: E402


class _Pools:
    """One live RankPool per world size, shared by the tests of a session; replaced after a failure."""

    def __init__(self):
        self._pools = {}

    def __call__(self, world: int) -> RankPool:
        pool = self._pools.get(world)
        if pool is None or pool.broken:
            if pool is not None:
                pool.close(force=True)
            pool = self._pools[world] = RankPool(world)
        return pool

    def close(self):
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def ranks():
    pools = _Pools()
    yield pools
    pools.close()
