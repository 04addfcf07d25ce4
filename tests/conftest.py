import atexit
import fnmatch
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import rank_pool  # noqa: E402
from rank_pool import RankPool  # noqa: E402

_REPOSITORY_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _root_entries():
    return sum(1 for entry in sys.path if os.path.abspath(entry or os.curdir) == _REPOSITORY_ROOT)


# How often the repository root is on sys.path when the run starts (PYTHONPATH, the working directory): a test or
# helper that adds it makes this process and every rank it spawns import torch_gemm_ar from the source tree, which in
# CI's clean clone has no compiled _C (tests/cached_build.root_script imports root scripts without it).
_ROOT_ENTRIES_AT_START = _root_entries()


def _check_root_not_added(when):
    if _root_entries() > _ROOT_ENTRIES_AT_START:
        # Removed again, so that only the test that added it fails.
        while _root_entries() > _ROOT_ENTRIES_AT_START:
            sys.path.remove(next(e for e in sys.path if os.path.abspath(e or os.curdir) == _REPOSITORY_ROOT))
        raise AssertionError(f"{when} put the repository root on sys.path: ranks would import torch_gemm_ar from "
                             "the source tree, not the installed package (use cached_build.root_script)")

# The `auto` tuner's decisions of a test run stay in the run (rank processes inherit this), not in ~/.cache.
if "TORCH_GEMM_AR_TUNE_CACHE" not in os.environ:
    _tune_dir = tempfile.mkdtemp(prefix="tgar-tune-")
    atexit.register(shutil.rmtree, _tune_dir, True)
    os.environ["TORCH_GEMM_AR_TUNE_CACHE"] = os.path.join(_tune_dir, "autotune.json")


class _Pools:
    """One live RankPool per world size, shared by the tests of a session; replaced after a failure. `extension_path`: the
    ranks load that build of torch_gemm_ar._C (the test build, `hooked_ranks`)."""

    def __init__(self, extension_path=None):
        self._pools = {}
        self._extension_path = extension_path

    def __call__(self, world: int) -> RankPool:
        pool = self._pools.get(world)
        if pool is None or pool.broken:
            if pool is not None:
                pool.close(force=True)
            pool = self._pools[world] = RankPool(world, extension_path=self._extension_path)
        return pool

    def close(self):
        for pool in self._pools.values():
            pool.close()


def _build_engine_observation():
    """Builds tests/engine_observation (cached under build/) before ranks start, so that a rank's first
    `observe.<name>()` loads it rather than building it inside a bounded call."""
    from engine_observation_build import observation_module_path

    observation_module_path()


@pytest.fixture(scope="session")
def simulator():
    """The kernel simulator (tests/kernel_sim_build.py), built once for every simulator test file of the session; its
    kernel objects are cached under build/tests/ and shared with the emulated NPU runtime (`emulated_npu`)."""
    from kernel_sim_build import build_simulator

    tmp = tempfile.mkdtemp(prefix="gemm_ar_sim_")
    try:
        yield build_simulator(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def npu_objects(tmp_path_factory):
    """NPU host sources compiled against the torch-npu headers, each once per session (test_npu_host_compile.py)."""
    from test_npu_host_compile import ObjectCache

    return ObjectCache(tmp_path_factory.mktemp("npu_host_objects"))


@pytest.fixture(scope="session")
def ranks():
    _build_engine_observation()
    pools = _Pools()
    yield pools
    pools.close()


@pytest.fixture(scope="session")
def hooked_ranks():
    """As `ranks`, with the test build of torch_gemm_ar._C in every rank (tests/hooked_build.py): for the negative
    controls, whose faults exist only there. Built at first use (about a minute on 2 cores), cached under build/."""
    from hooked_build import hooked_extension_path

    _build_engine_observation()
    pools = _Pools(extension_path=hooked_extension_path())
    yield pools
    pools.close()


@pytest.fixture(scope="session")
def emulated_npu():
    """(path, pools): the NPU host code on the emulated Ascend runtime (tests/npu_emulated_build.py), built once per
    change of its sources (docs/testing.md says how long; cached under build/), and rank pools of their own, whose
    processes load it (tests/npu_emulated_ranks.py). Skips without PTO_ISA_ROOT (the kernels are the simulator's)."""
    if not os.environ.get("PTO_ISA_ROOT"):
        pytest.skip("PTO_ISA_ROOT is not set: the emulated NPU runtime runs pto-isa's simulator kernels")
    from npu_emulated_build import emulated_library_path

    path = emulated_library_path()
    pools = _Pools()
    yield path, pools
    pools.close()


@pytest.fixture
def one_core_env(monkeypatch):
    """This process's engine settings as on a one-core rank (one compute thread, comm between tiles), no tile from
    the environment: for tests of the per-call geometry rules. Returns monkeypatch to change them further."""
    monkeypatch.delenv("TORCH_GEMM_AR_CPU_TILE", raising=False)
    monkeypatch.setenv("TORCH_GEMM_AR_COMPUTE_THREADS", "1")
    monkeypatch.setenv("TORCH_GEMM_AR_COMM_THREADS", "0")
    return monkeypatch


# --- test lanes (docs/testing.md) ----------------------------------------------------------------------------------
# Every test gets exactly one lane marker (registered in pyproject.toml), so that `pytest -m unit` is the fast lane.
# The first rule that matches decides: a lane marker the test carries itself; its module; a fixture it uses; a test
# function that starts its own RankPool; otherwise unit.
LANES = ("unit", "multirank", "simulator", "npu_compile", "benchmarks")
MODULE_LANES = {
    "test_kernels_sim*.py": "simulator",  # the kernel simulator (tests/kernel_sim_build.py)
    "test_kernels_device_build.py": "simulator",  # the kernels built by g++ and clang++
    "test_npu_call_sequence.py": "simulator",  # the NPU host against an emulated stream runtime (C++ harness)
    "test_npu_host_compile.py": "npu_compile",
    "test_npu_per_call_sync.py": "npu_compile",
    "test_benchmarks.py": "benchmarks",
    "test_npu_device.py": "multirank",  # one rank process per NPU (torch.multiprocessing)
}
FIXTURE_LANES = {"simulator": "simulator", "npu_objects": "npu_compile", "ranks": "multirank",
                 "hooked_ranks": "multirank", "emulated_npu": "multirank"}


def lane_of(item) -> str:
    own = [lane for lane in LANES if item.get_closest_marker(lane) is not None]
    if len(own) > 1:
        raise pytest.UsageError(f"{item.nodeid} is marked for more than one lane: {own}")
    if own:
        return own[0]
    module = os.path.basename(str(item.fspath))
    for pattern, lane in MODULE_LANES.items():
        if fnmatch.fnmatch(module, pattern):
            return lane
    for fixture in getattr(item, "fixturenames", ()):
        if fixture in FIXTURE_LANES:
            return FIXTURE_LANES[fixture]
    code = getattr(getattr(item, "function", None), "__code__", None)
    if code is not None and "RankPool" in code.co_names + code.co_varnames:  # `from rank_pool import RankPool`
        return "multirank"
    return "unit"


def pytest_collection_modifyitems(config, items):
    _check_root_not_added("collecting the tests")
    for item in items:
        lane = lane_of(item)
        if item.get_closest_marker(lane) is None:
            item.add_marker(lane)


@pytest.fixture(autouse=True)
def _repository_root_stays_off_sys_path(request):
    yield
    _check_root_not_added(request.node.nodeid)


@pytest.fixture(autouse=True)
def _rank_processes_only_in_multirank(request, monkeypatch):
    """A test outside the multirank lane that starts a RankPool fails and says so (lane_of could not see it)."""
    if request.node.get_closest_marker("multirank") is None:
        monkeypatch.setattr(rank_pool, "refuse_to_start", f"{request.node.nodeid} starts rank processes but is not "
                            "in the multirank lane: mark it @pytest.mark.multirank (docs/testing.md)")
