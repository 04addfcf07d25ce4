"""replace_megatron and the compile rewrite on Megatron-core's own models (megatron-core 0.19.2, CPU, gloo, 2 ranks):

- its ColumnParallelLinear + RowParallelLinear MLP (with and without sequence parallelism), and a 2-layer GPTModel (SwiGLU, RMSNorm), converted: outputs,
  input gradient and one SGD step equal Megatron's within fp32 tolerance, the report naming every linear layer;
- the GPTModel as it comes under torch.compile with the rewrite, forward and backward: Megatron warns on rank 0 only
  inside its layers' forward, so rank 0's graphs break where rank 1's do not; it runs correctly, without a hang, the
  sites rank 0 lacks unfused on both ranks (the report says so); with dynamo told to ignore warnings.warn the sites
  are fused; converted, it compiles whole;
- layers in configurations the converter does not take are listed with reasons.

CPU workarounds, none in Megatron's math: Megatron imports a triton-only MoE kernel module at import time
(megatron/core/transformer/moe/ops/paged_stash.py; triton is not installed on CPU), stubbed before the import; the
weights are initialized on CPU (use_cpu_initialization=True); gradient_accumulation_fusion is off (a CUDA kernel);
the RNG tracker is Megatron's inference tracker (its default one forks CUDA RNG states; dropout is 0 here);
torch.cuda.current_device() returns "cpu" while Megatron runs (it allocates the buffers of its sequence-parallel
all-gather / reduce-scatter and its attention scratch buffer on that device; in the ranks only); the causal mask is passed as a CPU tensor, with learned absolute
position embeddings (no RoPE kernels); the fused softmax / bias-dropout / norm kernels are off in the config.
"""
import contextlib
import importlib.util
import os
import random
import re
import shlex
import subprocess
import sys

import pytest
import torch
from rank_pool import free_port

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples"))

from megatron_cpu import stub_triton_only_module  # noqa: E402

H, F, ROWS = 24, 40, 7  # odd rows; F divisible by the tensor-parallel size
# Looked up without importing it: megatron.core imports only after the triton stub, in the rank processes.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="megatron-core is not installed (.ci/run installs it for the tests)")


@contextlib.contextmanager
def megatron_on_cpu(world):
    """Megatron's model-parallel state on these ranks (tensor-parallel size `world`), with the CPU workarounds of the
    module docstring; torn down after, so that the rank pool can run other tests."""
    stub_triton_only_module()
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    current_device = torch.cuda.current_device
    try:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        torch.cuda.current_device = lambda: "cpu"  # where Megatron allocates its buffers (see the module docstring)
        yield
    finally:
        torch.cuda.current_device = current_device
        parallel_state.destroy_model_parallel()


def _config(**extra):
    from megatron.core.transformer import TransformerConfig

    settings = dict(num_attention_heads=1, use_cpu_initialization=True, gradient_accumulation_fusion=False,
                    params_dtype=torch.float32)
    settings.update(extra)
    return TransformerConfig(**settings)


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


def _train_once(nets, x, upstream, forward):
    """Each net: forward, backward of (out * upstream).sum(), one SGD step; (output, input grad, parameters after)."""
    results = []
    for net in nets:
        xi = x.clone().requires_grad_() if x.is_floating_point() else x
        out = forward(net, xi)
        (out * upstream).sum().backward()
        torch.optim.SGD(net.parameters(), lr=0.1).step()
        results.append((out.detach(), xi.grad, {n: p.detach().clone() for n, p in net.named_parameters()}))
    return results


def _assert_same_training(rank, results, tolerance=3e-5):
    (out_ref, gx_ref, p_ref), (out, gx, p) = results
    torch.testing.assert_close(out, out_ref, rtol=tolerance, atol=tolerance, msg=lambda m: f"rank {rank} output: {m}")
    if gx_ref is not None:
        torch.testing.assert_close(gx, gx_ref, rtol=tolerance, atol=tolerance,
                                   msg=lambda m: f"rank {rank} input grad: {m}")
    assert p.keys() == p_ref.keys(), (p.keys(), p_ref.keys())
    for name in p:
        torch.testing.assert_close(p[name], p_ref[name], rtol=tolerance, atol=tolerance,
                                   msg=lambda m: f"rank {rank} {name} after one SGD step: {m}")


def megatron_mlp_matches(rank, world, seed, skip_bias_add_fc2, sequence_parallel):
    import torch_gemm_ar

    with megatron_on_cpu(world):
        config = _config(num_layers=1, hidden_size=H, sequence_parallel=sequence_parallel,
                         tensor_model_parallel_size=world, num_attention_heads=world)
        reference, model = _mlp(seed, config, skip_bias_add_fc2), _mlp(seed, config, skip_bias_add_fc2)
        report = torch_gemm_ar.nn.replace_megatron(model)
        g = torch.Generator().manual_seed(seed + 1)  # the same input and upstream gradient on every rank
        rows = ROWS * world if sequence_parallel else ROWS
        x = torch.randn(rows, 2, H, generator=g)
        upstream = torch.randn(rows, 2, H, generator=g)
        if sequence_parallel:  # Megatron's [s, b, h] layout: each rank holds its chunk of the sequence, in and out
            x, upstream = x.chunk(world)[rank], upstream.chunk(world)[rank]
        _assert_same_training(rank, _train_once((reference, model), x, upstream, _run))
        return (list(report), [(type(m).__name__, m.sequence_parallel) for m in (model.fc1, model.fc2)],
                str(report))


@pytest.mark.parametrize("skip_bias_add_fc2,sequence_parallel", [(False, False), (True, False), (False, True)])
def test_megatron_mlp_converted_matches_megatron(ranks, skip_bias_add_fc2, sequence_parallel):
    results = ranks(2).run(megatron_mlp_matches, random.randrange(1 << 30), skip_bias_add_fc2, sequence_parallel,
                           timeout_s=120)
    for replaced, types_now, text in results:
        assert replaced == ["fc1", "fc2"], text
        assert types_now == [("MegatronColumnParallelLinear", sequence_parallel),
                             ("MegatronRowParallelLinear", sequence_parallel)], types_now


def megatron_layers_left_alone(rank, world):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    import torch_gemm_ar

    with megatron_on_cpu(world):
        config = _config(num_layers=1, hidden_size=H)
        model = torch.nn.Module()
        model.gathered = ColumnParallelLinear(H, F, config=config, init_method=torch.nn.init.zeros_, bias=True,
                                              gather_output=True)
        model.scattering = RowParallelLinear(F, H, config=config, init_method=torch.nn.init.zeros_, bias=True,
                                             input_is_parallel=False, skip_bias_add=False)
        report = torch_gemm_ar.nn.replace_megatron(model)
        return list(report), dict(report.skipped), type(model.gathered).__name__


def test_megatron_layers_it_does_not_take_are_reported(ranks):
    replaced, skipped, kept = ranks(2).run(megatron_layers_left_alone)[0]
    assert replaced == [] and kept == "ColumnParallelLinear", (replaced, kept)
    assert "gather_output=True" in skipped["gathered"], skipped
    assert "input_is_parallel=False" in skipped["scattering"], skipped


VOCAB, SEQ, BATCH = 128, 9, 2
LINEAR_LAYERS = [f"decoder.layers.{i}.{name}" for i in range(2) for name in
                 ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")]


def _gpt(seed):
    """A 2-layer GPTModel (SwiGLU, RMSNorm, 4 heads) with Megatron's local (non-TE) layer spec."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = _config(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, normalization="RMSNorm",
                     gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
                     hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
                     masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=VOCAB, max_sequence_length=32, position_embedding_type="learned_absolute",
                    share_embeddings_and_output_weights=False)


def _gpt_inputs(seed):
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)  # True: masked out
    return tokens, positions, causal


def megatron_gpt_matches(rank, world, seed):
    import torch_gemm_ar

    with megatron_on_cpu(world):
        reference, model = _gpt(seed), _gpt(seed)
        report = torch_gemm_ar.nn.replace_megatron(model)
        tokens, positions, causal = _gpt_inputs(seed)
        # Each rank's logits are its shard of the vocabulary: an upstream gradient of its own, as a vocab-parallel
        # loss would give.
        upstream = torch.randn(BATCH, SEQ, VOCAB // world, generator=torch.Generator().manual_seed(seed + 2 + rank))
        results = _train_once((reference, model), tokens, upstream, lambda net, t: net(t, positions, causal))
        _assert_same_training(rank, results)
        return list(report), str(report)


def test_megatron_gpt_converted_matches_megatron(ranks):
    for replaced, text in ranks(2).run(megatron_gpt_matches, random.randrange(1 << 30), timeout_s=180):
        assert sorted(replaced) == sorted(LINEAR_LAYERS + ["output_layer"]), text


def _gpt_gradients(model, inputs, upstream, run=None):
    """`model`'s output and parameter gradients, run by `run` (e.g. its compiled form; default: itself)."""
    out = (model if run is None else run)(*inputs)
    (out * upstream).sum().backward()
    return out.detach(), {name: p.grad for name, p in model.named_parameters()}


def megatron_gpt_compiled(rank, world, seed):
    """The unconverted GPTModel compiled with the rewrite and trained one backward: as it comes (rank 0 warns, so its
    graphs break elsewhere), then with dynamo ignoring warnings.warn (alike graphs), then converted by
    replace_megatron and compiled whole (fullgraph: the converted layers do not warn). Output and every gradient equal
    the uncompiled model's each time; returns the first two reports."""
    import warnings

    import torch_gemm_ar
    from scoped_env import scoped_env

    reports = []
    with megatron_on_cpu(world), scoped_env(TORCH_GEMM_AR_COMPILE_AGREE_S="2"):
        inputs = _gpt_inputs(seed)
        upstream = torch.randn(BATCH, SEQ, VOCAB // world, generator=torch.Generator().manual_seed(seed + 2 + rank))
        expected, expected_grads = _gpt_gradients(_gpt(seed), inputs, upstream)
        for variant in ("as it comes", "warnings ignored", "converted"):
            torch._dynamo.reset()
            torch_gemm_ar.compile.reset()
            model = _gpt(seed)
            if variant == "converted":
                torch_gemm_ar.nn.replace_megatron(model)
            ignored = torch._dynamo.config.ignore_logging_functions
            if variant == "warnings ignored":
                ignored.add(warnings.warn)
            try:
                compiled = torch.compile(model, backend=torch_gemm_ar.compile.backend(inner="eager"),
                                         fullgraph=variant == "converted")
                got, grads = _gpt_gradients(model, inputs, upstream, run=compiled)
            finally:
                ignored.discard(warnings.warn)
            torch.testing.assert_close(got, expected, rtol=3e-5, atol=3e-5, msg=lambda m: f"rank {rank} {variant}: {m}")
            for name, grad in grads.items():
                torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-4,
                                           msg=lambda m: f"rank {rank} {variant} grad {name}: {m}")
            report = torch_gemm_ar.compile.report()
            reports.append((dict(report.rewritten), dict(report.skipped)))
    return reports[:2]


def test_megatron_gpt_compiles_when_ranks_trace_different_graphs(ranks):
    (as_is_0, alike_0), (as_is_1, alike_1) = ranks(2).run(megatron_gpt_compiled, random.randrange(1 << 30),
                                                           timeout_s=240)
    # As it comes: rank 0's graphs break inside the row-parallel layers, so no rank fuses them; rank 1 says why.
    assert as_is_0[0] == {} and as_is_1[0] == {}, (as_is_0, as_is_1)
    assert any("not rewritten: rank(s) [0]" in reason for reason in as_is_1[1]), as_is_1
    # Alike graphs: the row-parallel sites whose values backward does not keep (2 of linear_proj / linear_fc2 in
    # these training graphs) fused on both ranks.
    assert alike_0[0] == alike_1[0] == {"gemm_allreduce": 2}, (alike_0, alike_1)


@pytest.mark.multirank  # torchrun starts the ranks
def test_example_command_runs():
    """docs/adoption.md's torchrun line of examples/megatron_tp.py as typed, made tiny by options appended after it,
    on a free port: the converted modules, the CPU's name and its own tolerance check come out."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(repo, "docs", "adoption.md")) as f:
        lines = [m.group(1) for m in re.finditer(r"(torchrun [^`\n]*examples/megatron_tp\.py[^`\n]*)", f.read())]
    assert lines, "docs/adoption.md shows no torchrun command line for examples/megatron_tp.py"
    words = shlex.split(lines[0])
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    for model, converted in (("mlp", "replaced 2 module(s) with gemm_allreduce: fc1, fc2"),
                             ("gpt", "replaced 9 module(s)")):
        tiny = ["--model", model, "--hidden", "64", "--ffn", "96", "--tokens", "9", "--reps", "2"]
        env = dict(os.environ, PET_MASTER_PORT=str(free_port()), PET_MASTER_ADDR="127.0.0.1")
        done = subprocess.run([torchrun, *words[1:], *tiny], capture_output=True, text=True, timeout=300, cwd=repo,
                              env=env)
        assert done.returncode == 0, f"{lines[0]} {model} failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
        assert converted in done.stdout and "CPU:" in done.stdout and "train step:" in done.stdout, done.stdout
        assert done.stdout.rstrip().endswith("OK"), done.stdout
