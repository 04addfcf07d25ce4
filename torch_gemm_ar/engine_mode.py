"""Switches of the CPU fused engine for benchmarks and negative-control tests."""
import contextlib

from . import _C


@contextlib.contextmanager
def fused_engine_mode(overlap: bool = True):
    """Under overlap=False the CPU fused engine starts communicating only after the whole GEMM: the "sequential
    (same engine)" row of the benchmarks, against which overlap efficiency is measured
    (docs/decisions/0012-benchmark-measures.md). Process-wide; every rank
    must use the same mode for a call."""
    previous = _C._set_fused_overlap(bool(overlap))
    try:
        yield
    finally:
        _C._set_fused_overlap(previous)


@contextlib.contextmanager
def ignore_epochs_for_testing():
    """A deliberate protocol bug (flags from earlier calls count as ready) so that tests can show that their
    stress tests catch protocol errors. Never use it for real work."""
    previous = _C._set_ignore_epochs(True)
    try:
        yield
    finally:
        _C._set_ignore_epochs(previous)
