"""A bound on the collectives inside a converter's probe of a module.

A row-parallel layer's forward runs its own all_reduce. When that forward raises on one rank only (before or after
its collective), the other ranks wait in a collective their peer never joins, for the group's whole timeout (30
minutes by default for gloo). During a probe the group's timeout is therefore lowered to
TORCH_GEMM_AR_PROBE_TIMEOUT_S (default 120 s; never raised above the group's own), so the waiting ranks raise
too. Only a gloo backend's timeout is changed (that of the backend running the collectives on the probed layer's
device); other backends (NCCL, HCCL) keep their own bound, and their probes are bounded by it.
"""
import contextlib
import datetime
import os
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from .conversion import PROBE_ROWS

DEFAULT_PROBE_TIMEOUT_S = 120.0
MAX_PROBE_TIMEOUT_S = 86400.0  # a day; longer is no bound (and overflows timedelta at inf)


def probe_timeout_s() -> float:
    raw = os.environ.get("TORCH_GEMM_AR_PROBE_TIMEOUT_S", "")
    if not raw:
        return DEFAULT_PROBE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"TORCH_GEMM_AR_PROBE_TIMEOUT_S must be a number of seconds; got {raw!r}") from None
    if not 0 < value <= MAX_PROBE_TIMEOUT_S:
        raise ValueError(f"TORCH_GEMM_AR_PROBE_TIMEOUT_S must be a number of seconds in (0, {MAX_PROBE_TIMEOUT_S:g}]; "
                         f"got {raw!r}")
    return value


def _gloo_backend(group: dist.ProcessGroup, device: torch.device):
    """The gloo backend that runs `group`'s collectives on `device`'s tensors, or None (another backend: NCCL, HCCL)."""
    try:
        backend = group._get_backend(device)
    except Exception:  # no backend for this device type in the group
        return None
    return backend if isinstance(backend, dist.ProcessGroupGloo) else None


@contextlib.contextmanager
def bounded_group_timeout(group: dist.ProcessGroup, device: torch.device) -> Iterator[Optional[float]]:
    """Lowers the timeout of the backend that runs `group`'s collectives on `device` (the probed layer's weights) to
    the probe bound inside the block and restores it after; only a gloo backend, and no other backend of the group,
    is touched. Yields the bound in seconds that applies (None: the backend keeps its own)."""
    backend = _gloo_backend(group, device)
    previous = getattr(getattr(backend, "options", None), "_timeout", None)  # private in torch 2.13: may go
    set_timeout = getattr(backend, "_set_default_timeout", None)
    if not isinstance(previous, datetime.timedelta) or set_timeout is None:
        yield None
        return
    bound = datetime.timedelta(seconds=probe_timeout_s())
    if previous <= bound:
        yield previous.total_seconds()
        return
    set_timeout(bound)
    try:
        yield bound.total_seconds()
    finally:
        set_timeout(previous)


# What gloo's transport raises (as a plain RuntimeError in torch 2.13) when a peer never answers or has left.
_GLOO_FAILURES = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer")


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective that failed on this rank (timed out, or a peer left), rather than an error of
    the probed module's own code."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _GLOO_FAILURES)


def run_bounded_probe(probe: Callable[[], str], who: str, name: str, module: nn.Module, rank: int,
                      group: dist.ProcessGroup, stage: str = "forward") -> str:
    """`probe()` (one module's probe, collective) with its collectives bounded. Where its `stage` (forward or
    backward) raises on this rank, it raises here at once (ValueError); where a collective fails or times out on
    this rank (a peer's raised, or the layer reduces over a group some rank does not call), it raises naming the
    module too (RuntimeError). Either way every rank raises; the group is then unusable, as after any collective
    that one rank abandoned."""
    with bounded_group_timeout(group, module.weight.device) as bound_s:
        try:
            return probe()
        except Exception as exc:
            bound = "its group's timeout" if bound_s is None else f"{bound_s:g} s"
            described = f"{name!r} ({type(module).__name__})"
            if is_collective_failure(exc):
                raise RuntimeError(
                    f"{who}: probing {described} on rank {rank}: a collective failed or waited past {bound} "
                    f"(TORCH_GEMM_AR_PROBE_TIMEOUT_S): another rank's {stage} of it probably raised (see that "
                    f"rank's error); {type(exc).__name__}: {exc}") from exc
            raise ValueError(
                f"{who}: cannot replace {described}: its {stage} raised {type(exc).__name__}: {exc} on rank {rank} "
                f"while being probed with a random [{PROBE_ROWS}, {module.weight.shape[1]}] input; ranks whose "
                f"{stage} did not raise wait at most {'their group timeout' if bound_s is None else bound} in its "
                "collectives, then raise too") from exc
