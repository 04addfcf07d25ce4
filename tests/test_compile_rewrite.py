"""torch_gemm_ar.compile: the FX rewrite of GEMM + functional collective into the fused ops, under torch.compile on
real ranks. A DTensor-parallelized block (parallelize_module) compiled with the rewrite matches the uncompiled model
and a float64 reference, with the expected rewrite counts; graphs the rewrite must not touch (all_reduce max, a GEMM
output with another user, a bias added on every rank, a group of one) keep their collectives and their values.

Most cases run the rewritten AOT graphs as they are (backend(inner="eager")): Inductor code generation costs tens
of seconds per graph on the 2-core test machine; one case runs the Inductor post-grad pass (enable()) on a small
forward-only block.
"""
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torch_gemm_ar

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


class Block(nn.Module):
    """up (column-parallel) -> relu -> down (row-parallel, bias) -> residual add -> RMSNorm; then a second row-
    parallel layer whose output is returned as it is (no norm after it)."""

    def __init__(self, hidden, ffn):
        super().__init__()
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=True)
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.up2 = nn.Linear(hidden, ffn, bias=False)
        self.down2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        residual = x + self.down(torch.relu(self.up(x)))
        return residual, self.down2(torch.relu(self.up2(self.norm(residual))))


def _block(seed, hidden, ffn, dtype):
    torch.manual_seed(seed)  # the same full weights on every rank
    block = Block(hidden, ffn)
    with torch.no_grad():
        block.down.bias.normal_()
        block.norm.weight.uniform_(0.5, 1.5)
    return block.to(dtype)


def _parallel(block, world):
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel(), "up2": ColwiseParallel(), "down2": RowwiseParallel()}
    return parallelize_module(copy.deepcopy(block), mesh, plan)


def _check(out, ref, exact, dtype, what):
    """`out` within the dtype's tolerance of the float64 `exact`, and no further from it than `ref` is, plus slack."""
    scale = exact.abs().max().item() + 1.0
    err, ref_err = (out.double() - exact).abs().max().item(), (ref.double() - exact).abs().max().item()
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:.3g} vs float64 (scale {scale:.3g})"
    assert err <= 2 * ref_err + TOL[dtype] * scale / 4, f"{what}: {err:.3g}, the uncompiled model {ref_err:.3g}"


def dtensor_block_compiled(rank, world, seed, dtype_name, inner, drop_bias=False):
    torch._dynamo.reset()
    if drop_bias:  # negative control: a rewrite that loses the addmm's bias must fail the checks below
        from torch_gemm_ar.compile import rewrite

        original = rewrite._gemm
        rewrite._gemm = lambda node: (*original(node)[:2], None, None)
    dtype = getattr(torch, dtype_name)
    hidden, ffn = 24, 10 * world
    full = _block(seed, hidden, ffn, dtype)
    exact_model = _block(seed, hidden, ffn, torch.float64)
    model = _parallel(full, world)
    torch_gemm_ar.compile.reset()
    if inner == "inductor-pass":
        compiled = torch.compile(model)
        # Compilation happens at the calls: all of them inside enabled(); Inductor's caches off, so that every graph
        # is compiled (and counted) here rather than taken from an earlier run's cache.
        context = torch._inductor.config.patch(force_disable_caches=True)
        context.__enter__()
        torch_gemm_ar.compile.enable()
    else:
        compiled, context = torch.compile(model, backend=torch_gemm_ar.compile.backend(inner=inner)), None
    try:
        g = torch.Generator().manual_seed(seed + 1)
        for rows in (5, 7):  # fresh inputs; odd row counts (the second call recompiles with a dynamic size)
            x = torch.randn(2, rows, hidden, generator=g).to(dtype)
            with torch.no_grad():
                got, ref, exact = compiled(x), model(x), exact_model(x.double())
            for i, name in enumerate(("residual", "output")):
                _check(got[i], ref[i], exact[i], dtype, f"rank {rank} world {world} {inner} {dtype_name} rows {rows} "
                       f"{name}")
    finally:
        if context is not None:
            torch_gemm_ar.compile.disable()
            context.__exit__(None, None, None)
        if drop_bias:
            rewrite._gemm = original
    return dict(torch_gemm_ar.compile.report().rewritten)


@pytest.mark.parametrize("world,dtype,inner", [(2, "float32", "eager"), (3, "float32", "eager"),
                                               (2, "bfloat16", "eager"), (2, "float32", "inductor-pass")])
def test_dtensor_block_under_compile_is_rewritten(ranks, world, dtype, inner):
    counts = ranks(world).run(dtensor_block_compiled, random.randrange(1 << 30), dtype, inner, timeout_s=300)
    assert all(c == counts[0] for c in counts), counts
    # down + residual add + RMSNorm fuse into one op; down2 has no norm after it.
    assert counts[0].get("gemm_allreduce_add_rmsnorm", 0) >= 1, counts[0]
    assert counts[0].get("gemm_allreduce", 0) >= 1, counts[0]


def test_negative_control_a_wrong_rewrite_fails(ranks):
    from rank_pool import RankFailure

    with pytest.raises(RankFailure, match="max error"):
        ranks(2).run(dtensor_block_compiled, random.randrange(1 << 30), "float32", "eager", drop_bias=True)


def _funcol_model(case, group_name, world):
    import torch.distributed._functional_collectives as funcol

    def forward(x, w, bias):
        if case == "sum":
            return funcol.all_reduce(x @ w, "sum", group_name)
        if case == "max":
            return funcol.all_reduce(x @ w, "max", group_name)
        if case == "other-user":  # the product is also used unreduced: fusing would lose it
            y = x @ w
            return funcol.all_reduce(y, "sum", group_name) + y
        if case == "bias-every-rank":  # addmm with the whole bias on every rank: the sum counts it world times
            return funcol.all_reduce(torch.addmm(bias, x, w), "sum", group_name)
        if case == "reduce-scatter":
            return funcol.reduce_scatter_tensor(x @ w, "sum", 0, group_name)
        if case == "all-gather":
            return funcol.all_gather_tensor(x, 0, group_name) @ w
        raise ValueError(case)

    return forward


EXPECTED = {"sum": "gemm_allreduce", "reduce-scatter": "gemm_reduce_scatter", "all-gather": "allgather_gemm",
            "max": None, "other-user": None, "bias-every-rank": None}


def _compiled_recording_graphs(fn):
    """fn compiled with the rewrite (after a reset of its report), and the list its graphs' code is appended to."""
    graphs = []

    def recording_inner(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    torch_gemm_ar.compile.reset()
    return torch.compile(fn, backend=torch_gemm_ar.compile.backend(inner=recording_inner), fullgraph=True), graphs


def functional_graph(rank, world, seed, case):
    torch._dynamo.reset()
    fn = _funcol_model(case, dist.group.WORLD.group_name, world)
    g = torch.Generator().manual_seed(seed + rank)  # each rank's own shard
    rows = 6 * world  # divisible by the world size for reduce-scatter; odd shapes otherwise
    x, w, bias = torch.randn(rows, 7, generator=g), torch.randn(7, 5, generator=g), torch.randn(5, generator=g)
    compiled, graphs = _compiled_recording_graphs(fn)
    got, ref = compiled(x, w, bias), fn(x, w, bias)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    report = torch_gemm_ar.compile.report()
    return dict(report.rewritten), dict(report.skipped), graphs


@pytest.mark.parametrize("case", list(EXPECTED))
def test_functional_collective_graphs(ranks, case):
    results = ranks(2).run(functional_graph, random.randrange(1 << 30), case)
    rewritten, skipped, graphs = results[0]
    expected = EXPECTED[case]
    code = "\n".join(graphs)
    if expected is None:
        assert rewritten == {}, rewritten
        assert "pto." not in code and "_c10d_functional" in code, code
        assert skipped, "a site left alone has its reason counted"
    else:
        assert rewritten == {expected: 1}, (rewritten, skipped)
        assert f"pto.{expected}" in code and "_c10d_functional" not in code, code


def test_the_reasons_name_what_was_wrong(ranks):
    seed = random.randrange(1 << 30)
    reasons = {case: " ".join(ranks(2).run(functional_graph, seed, case)[0][1])
               for case in ("max", "other-user", "bias-every-rank")}
    assert "'max', not sum" in reasons["max"], reasons
    assert "other user" in reasons["other-user"], reasons
    assert "bias" in reasons["bias-every-rank"], reasons
    # A group of one rank: nothing to fuse, the graph stays as it was.
    rewritten, skipped, graphs = ranks(1).run(functional_graph, seed, "sum")[0]
    assert rewritten == {} and "one rank" in " ".join(skipped), skipped


def test_bad_inner_backend_is_named():
    with pytest.raises(ValueError, match="inner must be"):
        torch_gemm_ar.compile.backend(inner="no-such-backend")


def test_enable_chains_and_disable_restores():
    import torch._inductor.config as inductor_config

    before = inductor_config.post_grad_custom_post_pass
    torch_gemm_ar.compile.enable()
    torch_gemm_ar.compile.enable()  # idempotent
    assert torch_gemm_ar.compile.is_enabled()
    installed = inductor_config.post_grad_custom_post_pass
    assert installed.previous is before and installed.uuid() is not None
    torch_gemm_ar.compile.disable()
    assert inductor_config.post_grad_custom_post_pass is before and not torch_gemm_ar.compile.is_enabled()
    with torch_gemm_ar.compile.enabled():
        assert torch_gemm_ar.compile.is_enabled()
    assert inductor_config.post_grad_custom_post_pass is before


def test_the_rewrite_is_logged(caplog):
    """The per-graph report goes to the "torch_gemm_ar.compile" logger (checked in-process on a world-1 graph that
    the rewrite leaves alone, so no ranks are needed)."""
    import logging

    from torch import fx

    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(3, 4)
    ar = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "max", "0"))
    graph.output(graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,)))
    before = str(graph)
    with caplog.at_level(logging.INFO, logger="torch_gemm_ar.compile"):
        report = torch_gemm_ar.compile.rewrite_graph(graph)
    assert str(graph) == before and not report.rewritten
    assert any("left alone" in r.getMessage() and "'max'" in r.getMessage() for r in caplog.records), caplog.text


def dtensor_block_training(rank, world, seed):
    """Forward and backward compiled: the forward graph is rewritten (AOT's partitioned forward); the backward graph
    is AOT's own. Outputs and every gradient equal the uncompiled model's."""
    torch._dynamo.reset()
    hidden, ffn = 24, 6 * world
    full = _block(seed, hidden, ffn, torch.float32)
    model, reference = _parallel(full, world), _parallel(full, world)
    torch_gemm_ar.compile.reset()
    compiled = torch.compile(model, backend=torch_gemm_ar.compile.backend(inner="eager"))
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(3, 5, hidden, generator=g)
    upstream = [torch.randn(3, 5, hidden, generator=g) for _ in range(2)]
    xc, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    for net, xi in ((compiled, xc), (reference, xr)):
        outs = net(xi)
        sum((o * u).sum() for o, u in zip(outs, upstream)).backward()
    torch.testing.assert_close(xc.grad, xr.grad, rtol=1e-5, atol=1e-5)
    params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        got, want = p.grad, params[name].grad  # DTensor gradients for the parallelized weights
        got, want = (got.to_local(), want.to_local()) if hasattr(got, "to_local") else (got, want)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank} grad {name}: {m}")
    return sum(torch_gemm_ar.compile.report().rewritten.values())


def test_training_graphs_keep_their_gradients(ranks):
    rewritten = ranks(2).run(dtensor_block_training, random.randrange(1 << 30), timeout_s=300)
    assert rewritten[0] == rewritten[1] and rewritten[0] >= 1, rewritten


def _sequence_model(case, group_name, world):
    """3-D [B, S, D] activations scattered and gathered along the sequence dim, as DTensor's Shard(1) and
    spmd_types write them (funcol's scatter_dim / gather_dim 1 is DTensor's split + cat), and broken variants."""
    import torch.distributed._functional_collectives as funcol

    def forward(x, w, w3):
        if case == "scatter-seq":  # DTensor: mm, view, split dim 1, cat dim 0, reduce_scatter
            return funcol.reduce_scatter_tensor(x @ w, "sum", 1, group_name)
        if case == "scatter-seq-movedim":  # spmd_types: the sequence dim moved to the front, scattered, moved back
            y = (x @ w).movedim(1, 0).contiguous()
            return funcol.reduce_scatter_tensor(y, "sum", 0, group_name).movedim(0, 1)
        if case == "scatter-reversed":  # the chunks cat in another order: rank r would get chunk world-1-r
            y = x @ w
            return funcol.reduce_scatter_tensor(torch.cat(list(reversed(y.chunk(world, 1)))), "sum", 0, group_name)
        if case == "scatter-other-dim":  # split along the batch dim, cat along the sequence: no one dim's chunks
            y = x @ w
            return funcol.reduce_scatter_tensor(torch.cat(y.chunk(world, 0), 1), "sum", 0, group_name)
        if case == "gather-seq-two-gemms":  # DTensor: all_gather, split dim 0, cat dim 1; w1 and w3 on it
            gathered = funcol.all_gather_tensor(x, 1, group_name)
            return gathered @ w, gathered @ w3
        if case == "gather-seq-transposed":  # the sequence dim gathered at the front and moved back
            gathered = funcol.all_gather_tensor(x.transpose(0, 1).contiguous(), 0, group_name).transpose(0, 1)
            return torch.relu(gathered.reshape(-1, gathered.shape[-1]) @ w)  # (3-D @ would be a bmm)
        if case == "gather-reversed":  # the gathered chunks cat in reverse rank order
            gathered = funcol.all_gather_tensor(x, 0, group_name)
            return torch.cat(list(reversed(gathered.chunk(world, 0))), 1) @ w
        raise ValueError(case)

    return forward


SEQUENCE_EXPECTED = {"scatter-seq": "gemm_reduce_scatter", "scatter-seq-movedim": "gemm_reduce_scatter",
                     "scatter-reversed": None, "scatter-other-dim": None, "gather-seq-two-gemms": "allgather_gemm",
                     "gather-seq-transposed": "allgather_gemm", "gather-reversed": None}


def sequence_graph(rank, world, seed, case, dtype_name, any_order=False):
    """The case compiled (its rewritten graphs recorded) against the same function in float64. any_order: negative
    control, the row-map proof accepts any order (a wrong rewrite must fail the value check)."""
    torch._dynamo.reset()
    if any_order:
        from torch_gemm_ar.compile import rows

        original, rows.equal = rows.equal, lambda a, b: getattr(a, "shape", None) == b.shape
    try:
        return _sequence_graph(rank, world, seed, case, dtype_name)
    finally:
        if any_order:
            rows.equal = original


def _sequence_graph(rank, world, seed, case, dtype_name):
    dtype = getattr(torch, dtype_name)
    fn = _sequence_model(case, dist.group.WORLD.group_name, world)
    g = torch.Generator().manual_seed(seed + rank)  # each rank's own shard
    batch = world * world  # the batch is split in "scatter-other-dim", and the split cat along dim 0 again
    x = torch.randn(batch, 5 if case.startswith("gather") else 5 * world, 7, generator=g)
    w, w3 = torch.randn(7, 9, generator=g), torch.randn(7, 3, generator=g)
    compiled, graphs = _compiled_recording_graphs(fn)
    got, exact = compiled(x.to(dtype), w.to(dtype), w3.to(dtype)), fn(x.double(), w.double(), w3.double())
    for out, want in zip(got if isinstance(got, tuple) else [got], exact if isinstance(exact, tuple) else [exact]):
        assert out.shape == want.shape and out.dtype == dtype, (out.shape, want.shape, out.dtype)
        scale = want.abs().max().item() + 1.0
        err = (out.double() - want).abs().max().item()
        assert err <= TOL[dtype] * scale, f"rank {rank} {case} {dtype_name}: max error {err:.3g} (scale {scale:.3g})"
    report = torch_gemm_ar.compile.report()
    return dict(report.rewritten), dict(report.skipped), graphs


# Every case on 2 and 3 ranks in fp32; the rewritten ones in bf16 as well (the dtype does not change what matches).
SEQUENCE_SETUPS = [(w, "float32", c) for w in (2, 3) for c in SEQUENCE_EXPECTED] + [
    (2, "bfloat16", c) for c, expected in SEQUENCE_EXPECTED.items() if expected]


@pytest.mark.parametrize("world,dtype,case", SEQUENCE_SETUPS)
def test_sequence_dim_collectives_on_3d_activations(ranks, world, dtype, case):
    rewritten, skipped, graphs = ranks(world).run(sequence_graph, random.randrange(1 << 30), case, dtype)[0]
    expected = SEQUENCE_EXPECTED[case]
    code = "\n".join(graphs)
    if expected is None:
        assert rewritten == {}, rewritten
        assert "pto." not in code and "_c10d_functional" in code, code
        assert any("another order" in reason for reason in skipped), skipped
    else:
        # One fused op, no collective left: the second GEMM of "gather-seq-two-gemms" reads the op's gathered input.
        assert rewritten == {expected: 1}, (rewritten, skipped)
        assert f"pto.{expected}" in code and "_c10d_functional" not in code, code
        option = "scatter_dim = 1" if expected == "gemm_reduce_scatter" else "gather_dim = 1"
        assert option in code, code


@pytest.mark.parametrize("case", ["scatter-reversed", "gather-reversed"])
def test_negative_control_a_rewrite_in_the_wrong_order_fails(ranks, case):
    from rank_pool import RankFailure

    with pytest.raises(RankFailure, match="max error"):
        ranks(2).run(sequence_graph, random.randrange(1 << 30), case, "float32", any_order=True)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class SequenceParallelBlock(nn.Module):
    """RMSNorm -> SwiGLU feed-forward -> residual add, twice: the sequence-parallel layout of a Llama block."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.norms = nn.ModuleList([nn.RMSNorm(dim, eps=1e-5) for _ in range(2)])
        self.ffns = nn.ModuleList([FeedForward(dim, hidden) for _ in range(2)])

    def forward(self, x):
        for norm, ffn in zip(self.norms, self.ffns):
            x = x + ffn(norm(x))
        return x


def _sequence_parallel(block, world):
    """torchtitan's former DTensor plan: the norm sequence-parallel, one gather of its output at the feed-forward's
    input (PrepareModuleInput) for w1 and w3, w2 reduce-scattered back to sequence shards."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    mesh = init_device_mesh("cpu", (world,))
    plan = {}
    for i in range(2):
        plan.update({f"norms.{i}": SequenceParallel(),
                     f"ffns.{i}": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                     f"ffns.{i}.w1": ColwiseParallel(), f"ffns.{i}.w3": ColwiseParallel(),
                     f"ffns.{i}.w2": RowwiseParallel(output_layouts=Shard(1))})
    return parallelize_module(copy.deepcopy(block), mesh, plan)


def dtensor_sequence_parallel_training(rank, world, seed):
    """The DTensor sequence-parallel block compiled with the rewrite: outputs against float64 and the uncompiled
    model, then the input's and every weight's gradient equal to the uncompiled model's."""
    torch._dynamo.reset()
    dim, hidden, shard = 24, 10 * world, 5
    torch.manual_seed(seed)
    full = SequenceParallelBlock(dim, hidden)
    with torch.no_grad():
        for norm in full.norms:
            norm.weight.uniform_(0.5, 1.5)
    exact_model = copy_to(full, torch.float64)
    model, reference = _sequence_parallel(full, world), _sequence_parallel(full, world)
    torch_gemm_ar.compile.reset()
    compiled = torch.compile(model, backend=torch_gemm_ar.compile.backend(inner="eager"))
    g = torch.Generator().manual_seed(seed + 1)
    x_full = torch.randn(2, shard * world, dim, generator=g)
    upstream = torch.randn(2, shard * world, dim, generator=g)[:, rank * shard:(rank + 1) * shard]
    x = x_full[:, rank * shard:(rank + 1) * shard]
    exact = exact_model(x_full.double())[:, rank * shard:(rank + 1) * shard]
    xc, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    outs = []
    for net, xi in ((compiled, xc), (reference, xr)):
        out = net(xi)
        (out * upstream).sum().backward()
        outs.append(out.detach())
    _check(outs[0], outs[1], exact, torch.float32, f"rank {rank} world {world} sequence-parallel block")
    torch.testing.assert_close(xc.grad, xr.grad, rtol=1e-5, atol=1e-5)
    params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        got, want = p.grad, params[name].grad
        got, want = (got.to_local(), want.to_local()) if hasattr(got, "to_local") else (got, want)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank} grad {name}: {m}")
    report = torch_gemm_ar.compile.report()
    return dict(report.rewritten), dict(report.skipped)


def copy_to(module, dtype):
    import copy

    return copy.deepcopy(module).to(dtype)


@pytest.mark.parametrize("world", [2, 3])
def test_dtensor_sequence_parallel_block_trains_rewritten(ranks, world):
    results = ranks(world).run(dtensor_sequence_parallel_training, random.randrange(1 << 30), timeout_s=300)
    rewritten, skipped = results[0]
    assert all(r == results[0] for r in results), results
    # Forward, per block: w1 and w3 on one gather (one allgather_gemm), w2's reduce-scatter.
    assert rewritten.get("allgather_gemm", 0) >= 2 and rewritten.get("gemm_reduce_scatter", 0) >= 2, (rewritten,
                                                                                                     skipped)
