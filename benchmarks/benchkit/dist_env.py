"""Process setup of a benchmark run: (re)launch under torchrun, join the process group, pin threads, import the
library, and the device hooks (synchronize, hcom name) that differ between CPU and NPU."""
import datetime
import os
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Set by relaunch_under_torchrun so that the report can print the command the user actually typed.
LAUNCH_COMMAND_ENV = "GEMM_AR_BENCH_COMMAND"


def add_launch_arguments(parser, with_device: bool = True, timeout_help: str = "bound of every collective wait"):
    """The options every benchmark script shares: where it runs and how its ranks are launched and bounded."""
    if with_device:
        parser.add_argument("--device", choices=("cpu", "npu"), default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / local ranks)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to launch when not started by torchrun")
    parser.add_argument("--timeout-s", type=float, default=600.0, help=timeout_help)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def typed_command() -> str:
    """The command line that started this run, as the user can paste it again. Script arguments follow "--":
    torchrun's parser takes abbreviations, so a bare --m or --n would be read as one of its own options."""
    if os.environ.get(LAUNCH_COMMAND_ENV):
        return os.environ[LAUNCH_COMMAND_ENV]
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO_ROOT)
    args = " ".join(shlex.quote(a) for a in sys.argv[1:])
    nproc = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    nodes = int(os.environ.get("WORLD_SIZE", nproc)) // max(1, int(nproc))
    launcher = f"torchrun --nproc-per-node {nproc}" + (f" --nnodes {nodes}" if nodes > 1 else "")
    return f"{launcher} {script}" + (f" -- {args}" if args else "")


def relaunch_under_torchrun(nproc: int, timeout_s: Optional[float]) -> int:
    """Runs this very script again as `nproc` local ranks (torchrun on a free port) and returns its exit code; lets
    `python benchmarks/sweep.py --out DIR` work without typing torchrun. Bounded by timeout_s when given."""
    script = os.path.abspath(sys.argv[0])
    # "--" keeps torchrun's own parser (which accepts abbreviations) from reading --m or --n as its options.
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", script, "--", *sys.argv[1:]]
    env = dict(os.environ)
    env[LAUNCH_COMMAND_ENV] = " ".join(shlex.quote(a) for a in ["python", os.path.relpath(script, REPO_ROOT),
                                                                 *sys.argv[1:]])
    proc = subprocess.Popen(command, env=env)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(f"benchmark: gave up after {timeout_s:.0f} s (--timeout-s)", file=sys.stderr)
        return 124


def import_library():
    """torch_gemm_ar from the environment, else from this checkout (built in place with build_ext --inplace)."""
    try:
        import torch_gemm_ar
    except ImportError:
        sys.path.append(REPO_ROOT)
        import torch_gemm_ar
    return torch_gemm_ar


@dataclass
class DistEnv:
    rank: int
    world: int
    local_rank: int
    device: "object"  # torch.device
    threads: int
    group: "object"  # the WORLD ProcessGroup
    self_group: "object"  # a one-rank group of this rank: the library's no-communication path
    library: "object"  # the torch_gemm_ar module
    synchronize: Callable[[], None] = field(repr=False)
    hcom_name: Optional[str] = None  # NPU: HCCL communicator name of the world group

    def barrier(self):
        import torch.distributed as dist

        dist.barrier(group=self.group)


def start(device: str, threads: Optional[int], timeout_s: float) -> DistEnv:
    """Joins the process group of a torchrun job on `device` ("cpu" or "npu")."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if threads is None:
        # Ranks of one host share its cores; more threads than cores per rank only adds contention.
        threads = max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device == "npu":
        import torch_npu  # noqa: F401  (registers the npu device and the hccl backend)

        torch.npu.set_device(local_rank)
        dist.init_process_group("hccl", rank=rank, world_size=world, timeout=timeout)
        torch_device = torch.device("npu", local_rank)
        synchronize = torch.npu.synchronize
    elif device == "cpu":
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        torch_device = torch.device("cpu")

        def synchronize():
            return None
    else:
        raise ValueError(f"--device must be cpu or npu; got {device!r}")
    library = import_library()
    group = dist.group.WORLD
    # new_subgroups must be called by every rank; each rank gets its own one-member group back.
    self_group, _ = dist.new_subgroups(group_size=1)
    hcom = None
    if device == "npu":
        hcom = group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)
    return DistEnv(rank, world, local_rank, torch_device, threads, group, self_group, library, synchronize, hcom)


def stop():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", REPO_ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def library_env() -> List[str]:
    """The library's run-time knobs in effect (they change what is measured)."""
    return sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("TORCH_GEMM_AR_"))
