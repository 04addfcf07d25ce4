"""torchtitan 0.3.0's own Llama3 and tensor-parallel plan (examples/titan_llama.py), converted by
torch_gemm_ar.nn.replace_torchtitan: logits and one SGD step equal to torchtitan's TP, both SPMD backends, sequence
parallelism on and off, 2 and 3 ranks; the report names what converted and why the rest did not. Skipped, with the
reason, where torchtitan is not installed (CI installs it, .ci/run)."""
import os
import random
import re
import shlex
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchtitan", reason="needs torchtitan==0.3.0 (installed by .ci/run, with --no-deps)")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples"))

from rank_pool import free_port  # noqa: E402
from titan_llama import backend, build, local, sizes  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BACKENDS = ("spmd_types", "partial_dtensor")
ROWS = ("attention.wo", "feed_forward.w2")
QKV = ("attention.qkv_linear.wq", "attention.qkv_linear.wk", "attention.qkv_linear.wv")
FFN_COLUMNS = ("feed_forward.w1", "feed_forward.w3")


def _step(model, context, ids, target):
    """Logits, then one SGD step on a loss over this rank's vocabulary shard; (logits, grads, logits after)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with context():
        logits = model(ids)
        (local(logits) * target).sum().backward()
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        optimizer.step()
        with torch.no_grad():
            after = local(model(ids)).clone()
    return local(logits).detach().clone(), grads, after


def _full(grad):
    """A gradient's values: a DTensor's whole tensor (a Partial one reduced, on every rank alike), else local."""
    if grad is None:
        return None
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()


def _close(got, want, what):
    """fp32 agreement: the sums run in another order (fused reductions, gradients reduced per layer), so allow
    rounding of the size of the values' largest magnitude."""
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5 * scale, msg=lambda m: f"{what}: {m}")


def titan_converted_vs_tp(rank, world, spmd_backend, sequence_parallel, fuse_qkv):
    import torch_gemm_ar

    with backend(spmd_backend):
        reference, context = build(spmd_backend, sequence_parallel, world, seed=3, fuse_qkv=fuse_qkv)
        converted, _ = build(spmd_backend, sequence_parallel, world, seed=3, fuse_qkv=fuse_qkv)
        report = torch_gemm_ar.nn.replace_torchtitan(converted)
        again = torch_gemm_ar.nn.replace_torchtitan(converted)
        generator = torch.Generator().manual_seed(11)
        seq = 5 * world  # sequence shards of 5 rows with sequence parallelism
        ids = torch.randint(0, sizes(world)["vocab"], (2, seq), generator=generator)
        vocab_shard = sizes(world)["vocab"] // world  # the logits' last dim on this rank
        target = torch.randn(2, seq, vocab_shard, generator=torch.Generator().manual_seed(100 + rank))
        want = _step(reference, context, ids, target)
        got = _step(converted, context, ids, target)
        with context():  # a converted column layer on its own: its parent's collective would be missing
            try:
                converted.get_submodule("layers.0.feed_forward.w1")(torch.zeros(2, seq, sizes(world)["dim"]))
                misuse = "no error"
            except RuntimeError as error:
                misuse = str(error)
    qkv = "wqkv" if fuse_qkv else "wq/wk/wv"
    for what, a, b in (("logits", got[0], want[0]), ("logits after the SGD step", got[2], want[2])):
        _close(a, b, f"rank {rank}, {qkv}: {what}")
    assert got[1].keys() == want[1].keys()
    for name, g in got[1].items():
        assert (g is None) == (want[1][name] is None), name
        if g is not None:
            _close(g, want[1][name], f"rank {rank}, {qkv}: grad of {name}")
    kinds = {name: getattr(converted.get_submodule(name), "_torch_gemm_ar_fused", None) for name in report}
    return list(report), dict(report.skipped), kinds, list(again), str(report), misuse


# Every setup on 2 ranks; on 3 ranks one setup (spmd_types, sequence parallel), which keeps the test time small.
SETUPS = [(2, sp, backend) for backend in BACKENDS for sp in (True, False)] + [(3, True, "spmd_types")]


@pytest.mark.parametrize("world,sequence_parallel,spmd_backend", SETUPS,
                         ids=[f"{b}-{'sp' if sp else 'no_sp'}-{w}" for w, sp, b in SETUPS])
def test_converted_llama3_matches_torchtitan_tp(ranks, world, sequence_parallel, spmd_backend):
    """Each setup with both of torchtitan's QKV forms: wq/wk/wv (QKVLinear) and one wqkv (FusedQKVLinear, the
    default of its Llama3 flavours)."""
    row = "gemm_reduce_scatter" if sequence_parallel else "gemm_allreduce"
    column = "allgather_gemm" if sequence_parallel else "gemm_allreduce in backward"
    for fuse_qkv, qkv in ((False, QKV), (True, ("attention.qkv_linear.wqkv",))):
        results = ranks(world).run(titan_converted_vs_tp, spmd_backend, sequence_parallel, fuse_qkv, timeout_s=300)
        replaced, skipped, kinds, again, text, misuse = results[0]
        assert all(r[:4] == results[0][:4] for r in results), "ranks disagree on the report"
        layers = [f"layers.{i}.{n}" for i in range(2) for n in ROWS + qkv + FFN_COLUMNS]
        assert sorted(replaced) == sorted(layers), text
        assert kinds == {n: row if n.endswith(ROWS) else column for n in layers}, kinds
        assert again == [], "a second call converts nothing more"
        assert set(skipped) >= {"tok_embeddings", "lm_head", "norm", "layers.0.attention_norm", "layers.1.ffn_norm",
                                "layers.0.attention.inner_attention"}, text
        assert "column-parallel" in skipped["lm_head"] and "lookup" in skipped["tok_embeddings"], text
        assert f"replace_torchtitan: replaced {len(layers)} module(s)" in text
        assert all(r[5].startswith("replace_torchtitan: a converted column-parallel layer was called outside")
                   for r in results), misuse


def titan_nothing_convertible(rank, world):
    """Forward hooks (which would see the fused forward's shard tensors) on wo, wqkv, w1 and w2 of a one-layer model
    with torchtitan's fused QKV projection: nothing to convert, so a report naming every parallelized module with its
    reason."""
    import torch_gemm_ar

    with backend("spmd_types"):
        model, _ = build("spmd_types", True, world, seed=1, layers=1, fuse_qkv=True)
        for name in ("attention.wo", "attention.qkv_linear.wqkv", "feed_forward.w1", "feed_forward.w2"):
            model.layers["0"].get_submodule(name).register_forward_hook(lambda *args: None)
        report = torch_gemm_ar.nn.replace_torchtitan(model)
        configured = [n for n, m in model.named_modules() if getattr(m, "_sharding_config", None) is not None]
        # The converters that read torch's or transformers' style hooks name this one instead of finding nothing.
        pointers = []
        for convert in (torch_gemm_ar.nn.replace_row_parallel, torch_gemm_ar.nn.replace_column_parallel,
                        torch_gemm_ar.nn.replace_sequence_parallel):
            try:
                convert(model)
                pointers.append(f"{convert.__name__} raised nothing")
            except ValueError as error:
                pointers.append(str(error))
    return list(report), dict(report.skipped), configured, str(report), pointers


def titan_hook_on_rank_0_only(rank, world):
    """A forward hook on one row layer on rank 0 only: the ranks decide differently there, so no rank converts it
    (a rank converting it alone would run the project's op where its peers run torchtitan's all-reduce); the other
    layers convert, and the model still equals torchtitan's."""
    import torch_gemm_ar

    with backend("spmd_types"):
        reference, context = build("spmd_types", False, world, seed=5, layers=1)
        converted, _ = build("spmd_types", False, world, seed=5, layers=1)
        if rank == 0:
            converted.layers["0"].attention.wo.register_forward_hook(lambda *args: None)
        report = torch_gemm_ar.nn.replace_torchtitan(converted)
        ids = torch.randint(0, sizes(world)["vocab"], (2, 6), generator=torch.Generator().manual_seed(2))
        with context(), torch.no_grad():
            got, want = local(converted(ids)), local(reference(ids))
    _close(got, want, f"rank {rank}: logits")
    return list(report), dict(report.skipped)


def test_a_layer_the_ranks_decide_differently_is_converted_nowhere(ranks):
    for rank, (replaced, skipped) in enumerate(ranks(2).run(titan_hook_on_rank_0_only)):
        assert "layers.0.attention.wo" not in replaced and "layers.0.feed_forward.w2" in replaced, (rank, replaced)
        reason = skipped["layers.0.attention.wo"]
        assert reason.startswith("the ranks decide differently") and "rank 1: row" in reason, (rank, reason)


def test_nothing_convertible_is_a_report(ranks):
    replaced, skipped, configured, text, pointers = ranks(2).run(titan_nothing_convertible)[0]
    assert replaced == [], text
    # Every module with a sharding config is named, with its reason; the column layers under the skipped parents too.
    assert set(skipped) == set(configured), text
    assert "layers.0.attention.qkv_linear.wqkv" in skipped["layers.0.attention"], text
    assert "forward_hooks" in skipped["layers.0.attention.wo"] and "forward_hooks" in skipped["layers.0.feed_forward.w2"]
    assert "layers.0.feed_forward.w1" in skipped["layers.0.feed_forward"], text
    assert "forward_hooks" in skipped["layers.0.attention.qkv_linear.wqkv"], text
    assert skipped["layers.0.feed_forward.w3"].startswith("column-parallel; its input collective sits at"), text
    assert text.startswith("replace_torchtitan: replaced 0 module(s)"), text
    for who, message in zip(("replace_row_parallel", "replace_column_parallel", "replace_sequence_parallel"), pointers):
        assert message.startswith(f"{who}: the model was parallelized by torchtitan") and "replace_torchtitan" in message


@pytest.mark.multirank  # torchrun starts the ranks
def test_readme_example_command_runs():
    """The README's torchrun line of examples/titan_llama_tp.py as typed, made tiny by options appended after it
    (the last occurrence wins), on a free port: the report, its own tolerance check and both timings."""
    with open(os.path.join(REPO, "README.md")) as f:
        lines = [m.group(1) for m in re.finditer(r"(torchrun [^`\n]*examples/titan_llama_tp\.py[^`\n]*)", f.read())]
    assert lines, "README.md shows no torchrun command line for examples/titan_llama_tp.py"
    tiny = ["--layers", "1", "--dim", "48", "--hidden", "88", "--heads", "4", "--kv-heads", "2", "--vocab", "62",
            "--batch", "2", "--seq", "10", "--iters", "2", "--warmup", "0", "--seed", str(random.randrange(1 << 30))]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PET_MASTER_PORT=str(free_port()), PET_MASTER_ADDR="127.0.0.1")
    done = subprocess.run([torchrun, *shlex.split(lines[0])[1:], *tiny], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env=env)
    assert done.returncode == 0, f"{lines[0]} failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    assert "replace_torchtitan: replaced 5 module(s)" in done.stdout and "CPU:" in done.stdout, done.stdout
    assert re.search(r"from torchtitan's TP: \S+ \(tolerance \S+\); .*: ok", done.stdout), done.stdout
    assert re.search(r"ms/forward +\d", done.stdout) and re.search(r"ms/train step +\d", done.stdout), done.stdout


def titan_compiled_vs_tp(rank, world, spmd_backend, sequence_parallel, fuse_qkv, inner):
    """torchtitan's model as it comes (no conversion) compiled with the rewrite (inner "eager": AOT's graphs run as
    they are; "inductor": Inductor's, whose backward is compiled at the first backward call): logits, every
    gradient and the logits after one SGD step against torchtitan's eager TP, and the report."""
    import torch_gemm_ar

    torch._dynamo.reset()
    with backend(spmd_backend):
        reference, context = build(spmd_backend, sequence_parallel, world, seed=7, fuse_qkv=fuse_qkv)
        model, _ = build(spmd_backend, sequence_parallel, world, seed=7, fuse_qkv=fuse_qkv)
        torch_gemm_ar.compile.reset()
        compiled = torch.compile(model, backend=torch_gemm_ar.compile.backend(inner=inner))
        seq = 5 * world
        ids = torch.randint(0, sizes(world)["vocab"], (2, seq), generator=torch.Generator().manual_seed(13))
        target = torch.randn(2, seq, sizes(world)["vocab"] // world,
                             generator=torch.Generator().manual_seed(200 + rank))
        want = _step(reference, context, ids, target)
        got = _step(compiled, context, ids, target)
    for what, a, b in (("logits", got[0], want[0]), ("logits after the SGD step", got[2], want[2])):
        _close(a, b, f"rank {rank} compiled: {what}")
    grads = {name.removeprefix("_orig_mod."): g for name, g in got[1].items()}
    assert grads.keys() == want[1].keys(), (sorted(grads), sorted(want[1]))
    for name, g in grads.items():
        assert (g is None) == (want[1][name] is None), name
        if g is not None:
            _close(g, want[1][name], f"rank {rank} compiled: grad of {name}")
    report = torch_gemm_ar.compile.report()
    return dict(report.rewritten), dict(report.skipped)


# Inductor once (its code generation is slow on a 2-core machine), AOT's graphs as they are for the rest.
COMPILED = [(2, True, "spmd_types", True, "eager"), (2, True, "partial_dtensor", False, "eager"),
            (2, False, "spmd_types", True, "eager"), (2, False, "partial_dtensor", True, "eager"),
            (3, True, "spmd_types", False, "eager"),
            (2, True, "spmd_types", True, "inductor")]


@pytest.mark.parametrize("world,sequence_parallel,spmd_backend,fuse_qkv,inner", COMPILED,
                         ids=[f"{b}-{'sp' if sp else 'no_sp'}-{'wqkv' if f else 'wq_wk_wv'}-{w}-{i}"
                              for w, sp, b, f, i in COMPILED])
def test_compiled_llama3_is_rewritten_and_matches_torchtitan_tp(ranks, world, sequence_parallel, spmd_backend,
                                                                fuse_qkv, inner):
    results = ranks(world).run(titan_compiled_vs_tp, spmd_backend, sequence_parallel, fuse_qkv, inner,
                               timeout_s=900)
    rewritten, skipped = results[0]
    assert all(r == results[0] for r in results), "ranks disagree on the report"
    text = f"rewritten {rewritten}; left alone {skipped}"
    if sequence_parallel:
        # Each forward (training, and inference after the step), 2 layers: wo and w2 reduce-scattered (DTensor's
        # split/cat or spmd_types' movedim forms): 4; the attention's and the feed-forward's gathers each one
        # allgather_gemm for all their projections, and lm_head's gather: 5. Backward: the gathered output
        # gradients of wo, w2 (x2) into their input gradients: 4 more allgather_gemm; the input gradients'
        # reduce-scatters of one GEMM (lm_head; wqkv): at least 1 more.
        assert rewritten.get("gemm_reduce_scatter", 0) >= 2 * 4 + 1, text
        assert rewritten.get("allgather_gemm", 0) == 2 * 5 + 4, text
    else:
        # wo and w2 in both forwards (spmd_types: mm, clone, all_reduce, the clone followed), with the residual add
        # and the next RMSNorm at inference; in backward the input-gradient all-reduces of one GEMM (spmd_types).
        assert rewritten.get("gemm_allreduce_add_rmsnorm", 0) == 4 and rewritten.get("gemm_allreduce", 0) >= 4, text
    # What is left alone is counted with its reason: the embedding's collective is not after a GEMM.
    assert any("not a GEMM" in reason for reason in skipped), text


@pytest.mark.multirank  # torchrun starts the ranks
def test_compile_example_command_runs():
    """docs/adoption.md's `--compile eager` line of examples/titan_llama_tp.py as typed (the short one: no code
    generation), made tiny by options appended to it: the rewrite's report, the check against the model compiled
    without it, both timings."""
    with open(os.path.join(REPO, "docs", "adoption.md")) as f:
        text = f.read()
    lines = [m.group(1) for m in re.finditer(r"(torchrun [^`\n]*examples/titan_llama_tp\.py --compile eager)", text)]
    assert lines, "docs/adoption.md shows no --compile eager command line for examples/titan_llama_tp.py"
    tiny = ["--layers", "1", "--dim", "48", "--hidden", "88", "--heads", "4", "--kv-heads", "2",
            "--vocab", "62", "--batch", "2", "--seq", "10", "--iters", "2", "--warmup", "1",
            "--seed", str(random.randrange(1 << 30))]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PET_MASTER_PORT=str(free_port()), PET_MASTER_ADDR="127.0.0.1")
    done = subprocess.run([torchrun, *shlex.split(lines[0])[1:], *tiny], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env=env)
    assert done.returncode == 0, f"{lines[0]} failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    assert re.search(r"torch_gemm_ar.compile \(eager\): rewrote allgather_gemm x\d+, gemm_reduce_scatter x\d+",
                     done.stdout), done.stdout
    assert re.search(r"from the model compiled without the rewrite: \S+ \(tolerance \S+\); .*: ok", done.stdout)
    assert re.search(r"ms/forward +\d", done.stdout) and re.search(r"ms/train step +\d", done.stdout), done.stdout
