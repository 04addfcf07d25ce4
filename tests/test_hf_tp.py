"""Hugging Face transformers tensor parallelism (tp_plan="auto") without model changes: replace_row_parallel (and
replace_column_parallel, for training) on a tiny Llama loaded on real ranks, the torch.compile rewrite on the same
model, and the README's command line of examples/hf_llama_tp.py. Skipped, with the reason, where transformers is not
installed (the test extra has it)."""
import os
import random
import re
import shlex
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (pip install '.[test]' installs it)")

import torch_gemm_ar  # noqa: E402
from rank_pool import free_port  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = 2


def save_tiny_llama(path, world, seed):
    """Odd sizes: per-rank K of o_proj is 2 heads x 6 = 12, of down_proj 11 x ... (intermediate 22 * world)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = 2 * world
    config = LlamaConfig(vocab_size=53, hidden_size=6 * heads, intermediate_size=22 * world, num_hidden_layers=LAYERS,
                         num_attention_heads=heads, num_key_value_heads=world, max_position_embeddings=32)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from 1 so that their weights matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)


def _load(path, dtype=torch.float32, plan="auto"):
    """As under torchrun: transformers sizes the TP mesh from WORLD_SIZE (the rank pool's processes have no such
    variables; they are set for the call and restored)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    env = {"WORLD_SIZE": str(dist.get_world_size()), "RANK": str(dist.get_rank()), "LOCAL_RANK": str(dist.get_rank())}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return AutoModelForCausalLM.from_pretrained(path, tp_plan=plan, dtype=dtype)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _ids(seed, rows=7):
    return torch.randint(0, 53, (2, rows), generator=torch.Generator().manual_seed(seed))  # the same on every rank


def _close(got, want, exact, what, tol=2e-5):
    scale = exact.abs().max().item() + 1.0
    err = (got.double() - exact).abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3g} vs float64"
    assert (got.double() - want.double()).abs().max().item() <= tol * scale, f"{what}: differs from unconverted TP"


def _backward_gives_the_same_grads(converted, got, unconverted, want, seed, what):
    """Backward of both models' logits with one random upstream gradient: every parameter's gradient (its local
    shard for DTensors) equal."""
    upstream = torch.randn(got.shape, generator=torch.Generator().manual_seed(seed))
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    params = dict(unconverted.named_parameters())
    for name, p in converted.named_parameters():
        g, w = p.grad, params[name].grad
        g, w = (g.to_local(), w.to_local()) if hasattr(g, "to_local") else (g, w)
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: grad of {name}: {m}")


def hf_eager_conversion(rank, world, path, seed):
    from transformers import AutoModelForCausalLM

    exact_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    unconverted, converted = _load(path), _load(path)
    report = torch_gemm_ar.nn.replace_row_parallel(converted)
    expected = [f"model.layers.{i}.{leaf}" for i in range(LAYERS) for leaf in ("self_attn.o_proj", "mlp.down_proj")]
    assert list(report) == expected, report
    skipped = dict(report.skipped)
    assert "all_reduce follows a lookup" in skipped["model.embed_tokens"], skipped
    assert "all-gather" in skipped["lm_head"] and "column-parallel" in skipped["model.layers.0.mlp.up_proj"], skipped
    assert "skipped lm_head" in str(report)
    for rows in (7, 5):  # inference: transformers' local fast path (plain tensors, all_reduce in place)
        ids = _ids(seed + rows, rows)
        with torch.no_grad():
            got, want, exact = converted(ids).logits, unconverted(ids).logits, exact_model(ids).logits
        _close(got, want, exact, f"rank {rank} no_grad rows {rows}")
    # Training: transformers' DTensor path; logits and the gradients that reach the sharded weights.
    ids = _ids(seed + 1)
    for model in (converted, unconverted):
        model.zero_grad(set_to_none=True)
    got, want = converted(ids).logits, unconverted(ids).logits
    _close(got.detach(), want.detach(), exact_model(ids).logits.detach(), f"rank {rank} with grad")
    _backward_gives_the_same_grads(converted, got, unconverted, want, seed + 2, "row-parallel")
    # Naming the layers by pattern works too.
    by_name = _load(path)
    assert torch_gemm_ar.nn.replace_row_parallel(by_name, patterns=["*.o_proj", "*.down_proj"]) == expected
    with torch.no_grad():
        _close(by_name(_ids(seed)).logits, unconverted(_ids(seed)).logits, exact_model(_ids(seed)).logits, "patterns")
    # transformers' other all-reduce row style: "rowwise_split_input" (replicated input, sliced by the layer) after
    # "colwise_rep" layers (gathered outputs).
    plan = {f"model.layers.*.{k}": v for k, v in (
        ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"), ("self_attn.v_proj", "colwise"),
        ("self_attn.o_proj", "rowwise"), ("mlp.gate_proj", "colwise_rep"), ("mlp.up_proj", "colwise_rep"),
        ("mlp.down_proj", "rowwise_split_input"))}
    split_unconverted, split = _load(path, plan=plan), _load(path, plan=plan)
    assert torch_gemm_ar.nn.replace_row_parallel(split) == expected
    for module in (split.model.layers[0].mlp.down_proj, split.model.layers[0].self_attn.o_proj):
        assert isinstance(module, torch_gemm_ar.nn.DTensorRowParallelLinear), type(module)
    ids = _ids(seed + 3)
    with torch.no_grad():
        _close(split(ids).logits, split_unconverted(ids).logits, exact_model(ids).logits, "rowwise_split_input")
    got, want = split(ids).logits, split_unconverted(ids).logits  # with grad: transformers' DTensor path
    _close(got.detach(), want.detach(), exact_model(ids).logits.detach(), "rowwise_split_input with grad")
    hf_column_conversion(rank, path, seed, exact_model, unconverted)
    return True


def hf_column_conversion(rank, path, seed, exact_model, unconverted):
    """replace_column_parallel on the same model: transformers' "colwise" layers found without patterns (their
    backward all-reduce of the input gradient fused), "colwise_rep" (lm_head, a gathered output) left alone with the
    reason; logits without and with grad, and every gradient, equal the unconverted model's."""
    trained = _load(path)
    torch_gemm_ar.nn.replace_row_parallel(trained)
    report = torch_gemm_ar.nn.replace_column_parallel(trained)
    expected = [f"model.layers.{i}.{leaf}" for i in range(LAYERS) for leaf in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")]
    assert sorted(report) == sorted(expected), report
    assert isinstance(trained.model.layers[0].mlp.up_proj, torch_gemm_ar.nn.DTensorColumnParallelLinear)
    skipped = dict(report.skipped)
    assert list(skipped) == ["lm_head"] and "Shard(-1)" in skipped["lm_head"], skipped
    ids = _ids(seed + 4)
    with torch.no_grad():  # transformers' local inference path
        _close(trained(ids).logits, unconverted(ids).logits, exact_model(ids).logits, f"rank {rank} columns no_grad")
    for model in (trained, unconverted):
        model.zero_grad(set_to_none=True)
    got, want = trained(ids).logits, unconverted(ids).logits
    _close(got.detach(), want.detach(), exact_model(ids).logits.detach(), f"rank {rank} columns with grad")
    _backward_gives_the_same_grads(trained, got, unconverted, want, seed + 5, "columns")


@pytest.mark.parametrize("world", [2, 3])
def test_transformers_tp_model_converts_eagerly(ranks, tmp_path, world):
    seed = random.randrange(1 << 30)
    save_tiny_llama(str(tmp_path), world, seed)
    assert all(ranks(world).run(hf_eager_conversion, str(tmp_path), seed, timeout_s=300))


def hf_compiled(rank, world, path, seed):
    from transformers import AutoModelForCausalLM

    torch._dynamo.reset()
    exact_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    unconverted = _load(path)
    torch_gemm_ar.compile.reset()
    compiled = torch.compile(_load(path), backend=torch_gemm_ar.compile.backend(inner="eager"))
    ids = _ids(seed)
    with torch.no_grad():
        _close(compiled(ids).logits, unconverted(ids).logits, exact_model(ids).logits, f"rank {rank} compiled")
    return dict(torch_gemm_ar.compile.report().rewritten)


def test_transformers_tp_model_under_compile_is_rewritten(ranks, tmp_path):
    seed = random.randrange(1 << 30)
    save_tiny_llama(str(tmp_path), 2, seed)
    counts = ranks(2).run(hf_compiled, str(tmp_path), seed, timeout_s=300)
    # Every o_proj/down_proj reduction is followed by the residual add and the next RMSNorm (the last one by the
    # final norm), so every one fuses into gemm_allreduce_add_rmsnorm.
    assert counts[0] == counts[1] == {"gemm_allreduce_add_rmsnorm": 2 * LAYERS}, counts


@pytest.mark.multirank  # torchrun starts the ranks
def test_readme_example_command_runs(tmp_path):
    """The README's torchrun line of examples/hf_llama_tp.py as typed, made tiny by options appended after it (the
    last occurrence wins), on a free port; its table must come out and its own tolerance check pass."""
    with open(os.path.join(REPO, "README.md")) as f:
        lines = [m.group(1) for m in re.finditer(r"(torchrun [^`\n]*examples/hf_llama_tp\.py[^`\n]*)", f.read())]
    assert lines, "README.md shows no torchrun command line for examples/hf_llama_tp.py"
    words = shlex.split(lines[0])
    tiny = ["--layers", "1", "--hidden", "48", "--intermediate", "88", "--heads", "4", "--kv-heads", "2", "--vocab",
            "61", "--batch", "2", "--seq", "9", "--iters", "2", "--warmup", "0", "--compile-inner", "eager",
            "--seed", str(random.randrange(1 << 30))]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PET_MASTER_PORT=str(free_port()), PET_MASTER_ADDR="127.0.0.1")
    done = subprocess.run([torchrun, *words[1:], *tiny], capture_output=True, text=True, timeout=400, cwd=REPO,
                          env=env)
    assert done.returncode == 0, f"{lines[0]} failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    assert "converted (eager)" in done.stdout and "compiled + rewrite (eager)" in done.stdout, done.stdout
    assert "gemm_allreduce_add_rmsnorm x2" in done.stdout and "CPU:" in done.stdout, done.stdout
    # Training: the column-parallel layers converted too, the weights after one step checked, the step timed.
    assert "replace_column_parallel: replaced 5 module(s)" in done.stdout, done.stdout
    assert re.search(r"max \|weight difference\| after one step: \S+ \(tolerance \S+\): OK", done.stdout), done.stdout
    assert re.search(r"ms/step +\d", done.stdout), done.stdout
