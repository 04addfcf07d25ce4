"""replace_megatron on Megatron-core's own layers (megatron-core 0.19.2, CPU, gloo, 2 ranks): its ColumnParallelLinear
+ RowParallelLinear MLP, converted, gives Megatron's outputs, input gradient and one SGD step within fp32 tolerance,
with the report naming both layers; layers in configurations the converter does not take are listed with reasons.

CPU workarounds, none in Megatron's math: Megatron imports a triton-only MoE kernel module at import time
(megatron/core/transformer/moe/ops/paged_stash.py; triton is not installed on CPU), stubbed before the import; the
weights are initialized on CPU (use_cpu_initialization=True); gradient_accumulation_fusion is off (a CUDA kernel).
"""
import importlib.util
import random
import sys
import types

import pytest
import torch

H, F, ROWS = 24, 40, 7  # odd rows; F divisible by the tensor-parallel size
TRITON_ONLY = "megatron.core.transformer.moe.ops.paged_stash"
# Looked up without importing it: megatron.core imports only after the triton stub, in the rank processes.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="megatron-core is not installed (.ci/run installs it for the tests)")


def _stub_triton_only_module():
    """Megatron imports its MoE paged-stash triton kernels at import time; the MLP never calls them."""
    if TRITON_ONLY in sys.modules:
        return
    stub = types.ModuleType(TRITON_ONLY)
    stub.GLOBAL_BLOCK_SIZE = 1024

    def missing(name):
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args, **kwargs):
            raise RuntimeError(f"{TRITON_ONLY}.{name} needs triton (stubbed on CPU by tests/test_megatron.py)")
        return kernel

    stub.__getattr__ = missing
    sys.modules[TRITON_ONLY] = stub


def _mlp(seed, config, skip_bias_add_fc2=False):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(seed)  # the same full weights on every rank (Megatron's CPU init splits a master weight)

    def init(w):
        return torch.nn.init.normal_(w, std=0.1)

    mlp = torch.nn.Module()
    mlp.fc1 = ColumnParallelLinear(H, F, config=config, init_method=init, bias=True, gather_output=False,
                                   skip_bias_add=True)
    mlp.fc2 = RowParallelLinear(F, H, config=config, init_method=init, bias=True, input_is_parallel=True,
                                skip_bias_add=skip_bias_add_fc2)
    with torch.no_grad():
        mlp.fc1.bias.normal_()
        mlp.fc2.bias.normal_()
    return mlp


def _run(mlp, x):
    h, b1 = mlp.fc1(x)
    out, b2 = mlp.fc2(torch.nn.functional.gelu(h + b1))
    return out if b2 is None else out + b2


def megatron_mlp_matches(rank, world, seed, skip_bias_add_fc2):
    _stub_triton_only_module()
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    import torch_gemm_ar

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, use_cpu_initialization=True,
                                   gradient_accumulation_fusion=False, params_dtype=torch.float32)
        reference, model = _mlp(seed, config, skip_bias_add_fc2), _mlp(seed, config, skip_bias_add_fc2)
        report = torch_gemm_ar.nn.replace_megatron(model)
        g = torch.Generator().manual_seed(seed + 1)  # the same input and upstream gradient on every rank
        x = torch.randn(ROWS, 2, H, generator=g)
        upstream = torch.randn(ROWS, 2, H, generator=g)
        results = []
        for net in (reference, model):
            xi = x.clone().requires_grad_()
            out = _run(net, xi)
            (out * upstream).sum().backward()
            optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
            optimizer.step()
            results.append((out.detach(), xi.grad, {n: p.detach().clone() for n, p in net.named_parameters()}))
        (out_ref, gx_ref, p_ref), (out, gx, p) = results
        torch.testing.assert_close(out, out_ref, rtol=3e-5, atol=3e-5, msg=lambda m: f"rank {rank} output: {m}")
        torch.testing.assert_close(gx, gx_ref, rtol=3e-5, atol=3e-5, msg=lambda m: f"rank {rank} input grad: {m}")
        assert p.keys() == p_ref.keys(), (p.keys(), p_ref.keys())
        for name in p:
            torch.testing.assert_close(p[name], p_ref[name], rtol=3e-5, atol=3e-5,
                                       msg=lambda m: f"rank {rank} {name} after one SGD step: {m}")
        return list(report), [type(m).__name__ for m in (model.fc1, model.fc2)], str(report)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("skip_bias_add_fc2", [False, True])
def test_megatron_mlp_converted_matches_megatron(ranks, skip_bias_add_fc2):
    results = ranks(2).run(megatron_mlp_matches, random.randrange(1 << 30), skip_bias_add_fc2, timeout_s=120)
    for replaced, types_now, text in results:
        assert replaced == ["fc1", "fc2"], text
        assert types_now == ["MegatronColumnParallelLinear", "MegatronRowParallelLinear"], types_now


def megatron_layers_left_alone(rank, world):
    _stub_triton_only_module()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    import torch_gemm_ar

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, use_cpu_initialization=True,
                                   gradient_accumulation_fusion=False)
        model = torch.nn.Module()
        model.gathered = ColumnParallelLinear(H, F, config=config, init_method=torch.nn.init.zeros_, bias=True,
                                              gather_output=True)
        model.scattering = RowParallelLinear(F, H, config=config, init_method=torch.nn.init.zeros_, bias=True,
                                             input_is_parallel=False, skip_bias_add=False)
        report = torch_gemm_ar.nn.replace_megatron(model)
        return list(report), dict(report.skipped), type(model.gathered).__name__
    finally:
        parallel_state.destroy_model_parallel()


def test_megatron_layers_it_does_not_take_are_reported(ranks):
    replaced, skipped, kept = ranks(2).run(megatron_layers_left_alone)[0]
    assert replaced == [] and kept == "ColumnParallelLinear", (replaced, kept)
    assert "gather_output=True" in skipped["gathered"], skipped
    assert "input_is_parallel=False" in skipped["scattering"], skipped
