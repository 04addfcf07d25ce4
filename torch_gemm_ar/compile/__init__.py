"""torch.compile support without model changes: a graph rewrite of GEMM + collective into the fused ops.

Two ways to use it (see torch_gemm_ar/compile/rewrite.py for the patterns and the checks):

    torch_gemm_ar.compile.enable()               # Inductor: a custom post-grad pass (disable() undoes it)
    with torch_gemm_ar.compile.enabled(): ...    # the same, for a block
    torch.compile(model, backend=torch_gemm_ar.compile.backend(inner="inductor"))   # or inner="eager", or an
                                                 # aten-graph compiler such as torchair's get_compiler(config)

`report()` returns the counts since the last `reset()` (rewrites per pattern, sites left alone per reason); each
rewritten graph is also logged on the "torch_gemm_ar.compile" logger (INFO).

A site is rewritten only if every rank of its group compiles it too (agreement.py): compiling a graph with a site
waits up to TORCH_GEMM_AR_COMPILE_AGREE_S (60 s) for the group's other ranks; a site they do not all have keeps its
plain collective, and report() says why.
"""
import contextlib
import threading
from typing import Callable, Union

import torch

from .rewrite import RewriteReport, rewrite_graph

_lock = threading.Lock()
_total = RewriteReport()
_installed = []  # the post-grad passes that enable() replaced, innermost first


def report() -> RewriteReport:
    """A copy of what was rewritten (and left alone) since the last reset(), over every graph."""
    with _lock:
        copy = RewriteReport()
        copy.merge(_total)
        return copy


def reset() -> None:
    """Clear report()'s counts and start the ranks' agreement on sites afresh (agreement.restart()): call it on every
    rank of the group alike, e.g. with torch._dynamo.reset() before compiling again. A rank that resets alone meets
    its peers' agreements no more (nothing fused, report() says so) until they reset as well."""
    from . import agreement

    with _lock:
        _total.rewritten.clear()
        _total.skipped.clear()
    agreement.restart()


def _rewrite(graph: torch.fx.Graph) -> RewriteReport:
    result = rewrite_graph(graph)
    with _lock:
        _total.merge(result)
    return result


def _pass_base():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


class GemmCollectivePass(_pass_base()):
    """Inductor post-grad custom pass: the rewrite, then the pass that was installed before it (if any)."""

    def __init__(self, previous=None):
        self.previous = previous

    def __call__(self, graph: torch.fx.Graph) -> None:
        _rewrite(graph)
        if self.previous is not None:
            self.previous(graph)

    def uuid(self):
        # Inductor's FX graph cache keys on this: the rewrite's source, and the chained pass's own uuid. Between
        # ranks (a process group of more than one) the rewrite also depends on what the other ranks compile (the
        # agreement), which no cache key can hold: None, so Inductor bypasses its caches rather than serve one
        # rank a graph rewritten under another run's agreement.
        import torch.distributed as dist
        from torch._inductor.custom_graph_pass import get_hash_for_files

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return None

        from . import agreement, rewrite

        previous = None if self.previous is None else getattr(self.previous, "uuid", lambda: None)()
        return (get_hash_for_files((rewrite.__file__, agreement.__file__, __file__)), previous)


def enable() -> None:
    """Install the rewrite as Inductor's post_grad_custom_post_pass (chained in front of one already there)."""
    import torch._inductor.config as inductor_config

    with _lock:
        current = inductor_config.post_grad_custom_post_pass
        if isinstance(current, GemmCollectivePass):
            return
        _installed.append(current)
        inductor_config.post_grad_custom_post_pass = GemmCollectivePass(current)


def disable() -> None:
    """Restore the post-grad pass that enable() replaced. Graphs compiled meanwhile keep their rewrite."""
    import torch._inductor.config as inductor_config

    with _lock:
        if isinstance(inductor_config.post_grad_custom_post_pass, GemmCollectivePass) and _installed:
            inductor_config.post_grad_custom_post_pass = _installed.pop()


def is_enabled() -> bool:
    import torch._inductor.config as inductor_config

    return isinstance(inductor_config.post_grad_custom_post_pass, GemmCollectivePass)


@contextlib.contextmanager
def enabled():
    """enable() for the block, then disable() (compilation happens at the first call: call the model inside)."""
    was = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was:
            disable()


def backend(inner: Union[str, Callable] = "inductor"):
    """A torch.compile backend: the rewrite, then `inner`.

    inner="inductor": Inductor with the rewrite as its post-grad pass (for this backend only; enable() is not needed).
    inner="eager": AOT autograd's aten graphs, rewritten, run as they are (no code generation).
    inner=callable: an aten-graph compiler `(gm, example_inputs) -> callable`, called on every rewritten forward
    and backward graph (e.g. torchair's `get_compiler(config)`, the compiler its npu backend hands AOT autograd; its
    graph mode needs converters for the pto ops, which this project does not register yet: untested).
    """
    if inner == "inductor":
        def inductor_with_rewrite(gm, example_inputs):
            import torch._inductor.config as inductor_config
            from torch._inductor.compile_fx import compile_fx

            current = inductor_config.post_grad_custom_post_pass
            chained = current if isinstance(current, GemmCollectivePass) else GemmCollectivePass(current)
            # config_patches, not a patch around the call: AOT autograd compiles the backward graph later, at the
            # first backward, and compile_fx applies these patches there too.
            return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_post_pass": chained})

        return inductor_with_rewrite
    if inner == "eager":
        compile_graph = None
    elif callable(inner):
        compile_graph = inner
    else:
        raise ValueError(f"torch_gemm_ar.compile.backend: inner must be 'inductor', 'eager' or an aten-graph "
                         f"compiler (gm, example_inputs) -> callable; got {inner!r}")

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def rewrite_then_inner(gm: torch.fx.GraphModule, example_inputs):
        if _rewrite(gm.graph).rewritten:
            gm.recompile()
        compiled = gm.forward if compile_graph is None else compile_graph(gm, example_inputs)
        return compiled if hasattr(compiled, "_boxed_call") else make_boxed_func(compiled)

    return aot_autograd(fw_compiler=rewrite_then_inner, bw_compiler=rewrite_then_inner,
                        inference_compiler=rewrite_then_inner)


__all__ = ["GemmCollectivePass", "RewriteReport", "backend", "disable", "enable", "enabled", "is_enabled", "report",
           "reset", "rewrite_graph"]
