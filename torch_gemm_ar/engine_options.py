"""The CPU fused engine's options (csrc/host/cpu/engine_options.h): real A/B choices between data flows and tile
geometries, which benchmarks and tests compare. The defaults are what `fused` and `auto` use. Options are process-wide
and take effect from the next call; set them alike on every rank (ranks that differ raise on every rank, naming the
engine's options).

    with torch_gemm_ar.engine_options.override(overlap=False):   # the "sequential (same engine)" benchmark row
        out = torch_gemm_ar.gemm_allreduce(a, b, algorithm="fused")
"""
import contextlib

from . import _C


def current() -> dict:
    """Every option and its value in this process."""
    return dict(_C._engine_options())


@contextlib.contextmanager
def override(**options):
    """Sets the given options for the length of a `with` block, then restores them; an unknown name raises a
    ValueError listing the options."""
    previous = {}
    try:
        for name, value in options.items():
            previous[name] = _C._set_engine_option(name, value)
        yield
    finally:
        for name, value in previous.items():
            _C._set_engine_option(name, value)
