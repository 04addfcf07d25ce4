"""torch.compile(fullgraph=True) over a converted decoder block (both TP styles): one graph holding both fused
row-parallel ops and a backward graph with the column-parallel layers' fused input-gradient all-reduces, and forward
and backward equal to the unfused eager model.

The backend is aot_eager: it traces the whole block, forward and backward, through the op's fake kernel and autograd
formula, which is what fullgraph=True is about. Inductor's lowering of the op is tested in
tests/test_autograd_compile.py; inductor code generation for this block's forward and backward is too slow for this
suite.
"""
import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples"))

import tp_transformer as tp  # noqa: E402
import torch_gemm_ar  # noqa: E402
from test_nn_block import CONFIG, check, tensor_parallel  # noqa: E402


def compiled_block(rank, world, seed, style, algorithm):
    torch._dynamo.reset()
    cfg = tp.BlockConfig(**CONFIG, bias=True)
    full = tp.make_block(cfg, seed)
    unfused, converted = tensor_parallel(style, full, world), tensor_parallel(style, full, world)
    patterns = None if style == "dtensor" else tp.ROW_PARALLEL_PATTERNS
    torch_gemm_ar.nn.replace_row_parallel(converted, patterns=patterns, algorithm=algorithm)
    # And the column-parallel layers, whose backward all-reduce of the input gradient becomes a gemm_allreduce.
    patterns = None if style == "dtensor" else tp.COLUMN_PARALLEL_PATTERNS
    torch_gemm_ar.nn.replace_column_parallel(converted, patterns=patterns, algorithm=algorithm)

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs, backward_graphs = [], []

    def backward_compiler(gm, example_inputs):
        backward_graphs.append(gm)
        return make_boxed_func(gm.forward)

    # aot_eager, recording the backward graph too
    aot = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=backward_compiler)

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return aot(gm, example_inputs)

    compiled = torch.compile(converted, fullgraph=True, backend=recording_backend)
    g = torch.Generator().manual_seed(seed + 3)
    for step, seq in enumerate((7, 7)):  # the second call must reuse the graph
        x = torch.randn(2, seq, cfg.hidden, generator=g)
        upstream = torch.randn(2, seq, cfg.hidden, generator=g)
        xc, xu = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = compiled(xc)
        (out * upstream).sum().backward()
        ref = unfused(xu)
        (ref * upstream).sum().backward()
        what = f"{style} step {step} rank {rank}"
        check(out, ref, 1e-5, what + " output")
        check(xc.grad, xu.grad, 1e-5, what + " input grad")
        unfused_params = dict(unfused.named_parameters())
        for name, p in converted.named_parameters():
            check(tp.local_tensor(p.grad), tp.local_tensor(unfused_params[name].grad), 1e-5, f"{what} grad {name}")
        for model in (converted, unfused):
            model.zero_grad(set_to_none=True)

    fused_calls = [sum("gemm_allreduce" in str(node.target) for node in gm.graph.nodes) for gm in graphs]
    assert fused_calls == [2], f"gemm_allreduce calls per compiled graph: {fused_calls} (expected one graph, 2 calls)"
    # The five column-parallel layers' input gradients, each all-reduced by one gemm_allreduce in backward.
    backward_calls = [sum("gemm_allreduce" in str(node.target) for node in gm.graph.nodes) for gm in backward_graphs]
    assert backward_calls == [5], f"gemm_allreduce calls per backward graph: {backward_calls}"


@pytest.mark.parametrize("style,algorithm", [("plain", "fused"), ("dtensor", "chunked")])
def test_compile_fullgraph_over_converted_block(ranks, style, algorithm):
    ranks(2).run(compiled_block, random.randrange(1 << 30), style, algorithm, timeout_s=120)
