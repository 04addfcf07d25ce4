"""ColumnParallelLinear(sequence_parallel=False) on real ranks against the full nn.Linear in float64 (the input
gradient all-reduced in backward by gemm_allreduce), and replace_column_parallel on the plain Megatron-style block
of examples/tp_transformer.py: the converted block trains as the unfused one, and layers that are not column-parallel
are refused on every rank with the reason. (The DTensor ColwiseParallel path, and both paths against the float64
block: tests/test_nn_block.py.)"""
import copy
import os
import random
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples"))

import tp_transformer as tp  # noqa: E402
import torch_gemm_ar  # noqa: E402
from expect import raises, seconds_until_raised_within_probe_bound  # noqa: E402
from inputs import assert_matches  # noqa: E402
from test_nn_row_parallel_linear import LEAD_SHAPES, check_close, full_linear  # noqa: E402
from torch_gemm_ar.nn import ColumnParallelLinear, replace_column_parallel  # noqa: E402


def forward_backward_vs_full(rank, world, seed, dtype, algorithm):
    rows_per_rank, in_features = 7, 37  # neither a multiple of any tile size
    out_features = rows_per_rank * world
    rows = slice(rank * rows_per_rank, (rank + 1) * rows_per_rank)
    for case, lead in enumerate(LEAD_SHAPES):
        bias = case % 2 == 0
        full = full_linear(seed + case, in_features, out_features, bias)
        layer = ColumnParallelLinear.from_linear(copy.deepcopy(full).to(dtype), sequence_parallel=False,
                                                 algorithm=algorithm)
        g = torch.Generator().manual_seed(seed + 1000 + case)  # the same on every rank: the input is replicated
        x_full = torch.randn(*lead, in_features, generator=g, dtype=torch.float64)
        upstream = torch.randn(*lead, out_features, generator=g, dtype=torch.float64)

        x = x_full.to(dtype, copy=True).requires_grad_()
        out = layer(x)
        (out * upstream[..., rows].to(dtype)).sum().backward()
        x_ref = x_full.clone().requires_grad_()
        ref = full(x_ref)
        (ref * upstream).sum().backward()

        what = f"{algorithm} {dtype} lead={lead} bias={bias} rank={rank}"
        assert_matches(out, ref.detach()[..., rows], dtype, in_features, 1, what + " output")
        check_close(x.grad, x_ref.grad, dtype, out_features, what + " grad x")
        if world > 1:
            # The check above can fail: this rank's own part of the gradient, without the all-reduce, does not pass.
            local = upstream[..., rows] @ full.weight.detach()[rows]
            with pytest.raises(AssertionError):
                check_close(local.to(dtype), x_ref.grad, dtype, out_features, what + " local part")
        terms = max(1, x_full[..., 0].numel())
        check_close(layer.weight.grad, full.weight.grad[rows], dtype, terms, what + " grad weight")
        assert layer.weight.grad.stride() == layer.weight.stride(), what + ": the weight's gradient has other strides"
        if bias:
            check_close(layer.bias.grad, full.bias.grad[rows], dtype, terms, what + " grad bias")


DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_backward_match_full_linear(ranks, world, dtype):
    # Every algorithm over the six cases, fixed per case so that a failure reproduces with its algorithm.
    algorithm = ["sequential", "chunked", "fused", "auto"][(3 * (world - 2) + DTYPES.index(dtype)) % 4]
    ranks(world).run(forward_backward_vs_full, random.randrange(1 << 30), dtype, algorithm)


def under_autocast(rank, world, seed):
    """Mixed precision: fp32 parameters, the GEMMs in bf16 under torch.autocast; gradients come back in fp32 and
    match the float64 layer within bf16's tolerance."""
    rows = slice(rank * 6, (rank + 1) * 6)
    full = full_linear(seed, 29, 6 * world, bias=True)
    layer = ColumnParallelLinear.from_linear(copy.deepcopy(full).float(), sequence_parallel=False, algorithm="fused")
    g = torch.Generator().manual_seed(seed + 1)
    x_full = torch.randn(3, 5, 29, generator=g, dtype=torch.float64)
    upstream = torch.randn(3, 5, 6 * world, generator=g, dtype=torch.float64)
    x = x_full.float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16, out.dtype
    (out.float() * upstream[..., rows].float()).sum().backward()
    x_ref = x_full.clone().requires_grad_()
    (full(x_ref) * upstream).sum().backward()
    assert x.grad.dtype == layer.weight.grad.dtype == torch.float32
    check_close(x.grad, x_ref.grad, torch.bfloat16, 6 * world, "autocast grad x")
    check_close(layer.weight.grad, full.weight.grad[rows], torch.bfloat16, 15, "autocast grad weight")


def test_autocast(ranks):
    ranks(2).run(under_autocast, random.randrange(1 << 30))


def frozen_input_runs_no_collective(rank, world, seed):
    """An input that needs no gradient (the first layer of a model): backward computes the weight's gradient only
    and calls no gemm_allreduce (a rank that did would wait for peers that do not)."""
    from torch_gemm_ar.nn import reduced_input_grad

    def no_call(*args, **kwargs):
        raise AssertionError("backward called gemm_allreduce for an input that needs no gradient")

    full = full_linear(seed, 9, 4 * world, bias=True).float()
    layer = ColumnParallelLinear.from_linear(full, sequence_parallel=False)
    x = torch.randn(2, 3, 9, generator=torch.Generator().manual_seed(seed))
    saved, reduced_input_grad.gemm_allreduce = reduced_input_grad.gemm_allreduce, no_call
    try:
        layer(x).square().sum().backward()
    finally:
        reduced_input_grad.gemm_allreduce = saved
    out = layer(x).detach()
    torch.testing.assert_close(layer.weight.grad, (2 * out).reshape(-1, 4).t() @ x.reshape(-1, 9))
    torch.testing.assert_close(layer.bias.grad, (2 * out).reshape(-1, 4).sum(0))


def test_input_without_grad_runs_no_collective(ranks):
    ranks(2).run(frozen_input_runs_no_collective, random.randrange(1 << 30))


def convert_plain_block(rank, world, seed):
    """The plain block converted (row- and column-parallel layers) computes and trains as the unfused one; the
    converted layers hold the very Parameter objects of the original ones."""
    cfg = tp.BlockConfig(hidden=24, heads=world * 2, ffn=10 * world)
    unfused = tp.tensor_parallel_plain(tp.make_block(cfg, seed), dist.group.WORLD)
    converted = copy.deepcopy(unfused)
    before = {name: p for name, p in converted.named_parameters()}
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (unfused, converted)]
    replaced = replace_column_parallel(converted, patterns=tp.COLUMN_PARALLEL_PATTERNS, algorithm="fused")
    assert sorted(replaced) == sorted(tp.COLUMN_PARALLEL), replaced
    replaced += torch_gemm_ar.nn.replace_row_parallel(converted, patterns=tp.ROW_PARALLEL_PATTERNS, algorithm="fused")
    assert isinstance(converted.mlp.up_proj, ColumnParallelLinear) and not converted.mlp.up_proj.sequence_parallel
    assert dict(converted.named_parameters()) == before, "the converted layers must adopt the same Parameters"
    assert replace_column_parallel(converted, patterns=tp.COLUMN_PARALLEL_PATTERNS) == [], "converted twice"

    g = torch.Generator().manual_seed(seed + 1)
    for step in range(3):
        x = torch.randn(2, 5, cfg.hidden, generator=g)
        target = torch.randn(2, 5, cfg.hidden, generator=g)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        for model, opt, xi in zip((unfused, converted), opts, xs):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(xi), target).backward()
            opt.step()
        torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-4, atol=1e-5, msg=f"step {step}: input gradient")
    trained = dict(converted.named_parameters())
    for name, p in unfused.named_parameters():
        torch.testing.assert_close(trained[name], p, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} after 3 steps: {m}")


@pytest.mark.parametrize("world", [2, 3])
def test_converted_plain_block_trains_as_unfused(ranks, world):
    ranks(world).run(convert_plain_block, random.randrange(1 << 30))


class Holder(nn.Module):
    def __init__(self, **children):
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)


class FailsOnOneRank(nn.Module):
    """A column-parallel-looking layer whose forward raises on rank 1 only (or whose output is detached)."""

    def __init__(self, rank, detach=False):
        super().__init__()
        self.rank, self.detach = rank, detach
        self.weight = nn.Parameter(torch.ones(4, 12))

    def forward(self, x):
        if self.detach:
            return F.linear(x, self.weight).detach()
        if self.rank == 1:
            raise RuntimeError("boom")
        return F.linear(x, self.weight)


def converter_misuse(rank, world, seed):
    block = tp.tensor_parallel_plain(tp.make_block(tp.BlockConfig(hidden=12, heads=world, ffn=3 * world), seed),
                                     dist.group.WORLD)
    # A bare nn.Linear shard: its input gradient is this rank's part; the model would reduce it elsewhere.
    bare = Holder(q_proj=nn.Linear(12, 4))  # the module's own initialisation: it differs per rank, as shards do
    raises(lambda: replace_column_parallel(bare, patterns=["q_proj"]), "'q_proj'", "this rank's part",
           "ColumnParallelLinear(sequence_parallel=False)", exc=ValueError)
    assert type(bare.q_proj) is nn.Linear, "a failed call must leave the model untouched"
    # A row-parallel layer reduces its output: not the local product.
    raises(lambda: replace_column_parallel(block, patterns=["*.o_proj"]), "'self_attn.o_proj'",
           "not this rank's x @ weight.T", exc=ValueError)
    # One bad layer among good ones: nothing replaced.
    raises(lambda: replace_column_parallel(block, patterns=["*.q_proj", "*.down_proj"]), "'mlp.down_proj'",
           exc=ValueError)
    assert type(block.self_attn.q_proj) is tp.UnfusedColumnParallelLinear, "nothing replaced after a failure"
    raises(lambda: replace_column_parallel(block, patterns=["input_layernorm"]), "expected a 2-D floating "
           "[out/world, in] shard", exc=ValueError)
    # A forward that raises on one rank: every rank reports it, and none waits in the probe's backward.
    raises(lambda: replace_column_parallel(Holder(p=FailsOnOneRank(rank)), patterns=["p"]),
           "its forward raised RuntimeError: boom (on rank 1)", exc=ValueError)
    raises(lambda: replace_column_parallel(Holder(p=FailsOnOneRank(rank, detach=True)), patterns=["p"]),
           "does not depend on its input", exc=ValueError)
    # Shards that disagree between ranks: reported on every rank before anything is probed.
    uneven = Holder(p=nn.Linear(6 + (rank == 1), 4))
    raises(lambda: replace_column_parallel(uneven, patterns=["p"]), "ranks disagree on its shapes", exc=ValueError)
    # Patterns and arguments.
    raises(lambda: replace_column_parallel(block, patterns=["*.c_attn"]), "match no module", exc=ValueError)
    raises(lambda: replace_column_parallel(block, patterns=[]), "non-empty", exc=ValueError)
    raises(lambda: replace_column_parallel(block, patterns=["*.q_proj"], algorithm="fastest"),
           "algorithm must be one of", exc=ValueError)
    raises(lambda: replace_column_parallel(block), "found no module parallelized with ColwiseParallel",
           "patterns=[...]", exc=ValueError)
    # DTensor: a sequence-parallel ColwiseParallel (input Shard(1)) is replace_sequence_parallel's.
    from torch.distributed.device_mesh import init_device_mesh

    sp = tp.tensor_parallel_sequence(tp.make_block(tp.BlockConfig(hidden=12, heads=world, ffn=3 * world), seed),
                                     init_device_mesh("cpu", (world,)))
    raises(lambda: replace_column_parallel(sp, patterns=["*.q_proj"]), "'self_attn.q_proj'",
           "replace_sequence_parallel converts", exc=ValueError)
    # Found without patterns, they are reported as left alone, with that reason.
    report = replace_column_parallel(sp)
    assert report == [] and sorted(name for name, _ in report.skipped) == sorted(tp.COLUMN_PARALLEL), report.skipped
    assert all("replace_sequence_parallel converts" in reason for _, reason in report.skipped), report.skipped
    # The group still works, and the right layers still convert.
    assert replace_column_parallel(block, patterns=["*.q_proj"]) == ["self_attn.q_proj"]


@pytest.mark.parametrize("world", [2, 3])
def test_converter_misuse_raises_on_every_rank(ranks, world):
    ranks(world).run(converter_misuse, random.randrange(1 << 30))


def dtensor_plan(rank, world, seed, algorithm):
    """torch's ColwiseParallel layers found without patterns: a plain input, a DTensor input with a DTensor output
    (use_local_output=False), and a gathered-output layer left alone and reported; forward and backward equal the
    unconverted model's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))

    def model():
        g = torch.Generator().manual_seed(seed)  # the same full weights on every rank, sharded by the plan
        m = Holder(q=nn.Linear(13, 5 * world), k=nn.Linear(13, 3 * world, bias=False), head=nn.Linear(13, 4 * world),
                   o=nn.Linear(6 * world, 13))
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        plan = {"q": ColwiseParallel(), "k": ColwiseParallel(use_local_output=False),
                "head": ColwiseParallel(output_layouts=Replicate()), "o": RowwiseParallel()}
        return parallelize_module(m, mesh, plan)

    unfused, converted = model(), model()
    # group= for DTensor layers must be the mesh's: another group of the same ranks is refused by name.
    other = dist.new_group(list(range(world)))
    raises(lambda: replace_column_parallel(converted, patterns=["q"], group=other), "'q'", "wrong group",
           exc=ValueError)
    report = replace_column_parallel(converted, group=mesh.get_group(), algorithm=algorithm)
    assert sorted(report) == ["k", "q"], report
    assert [name for name, _ in report.skipped] == ["head"] and "Shard(-1)" in report.skipped[0][1], report.skipped
    assert replace_column_parallel(converted) == [], "converted twice"

    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 3, 13, generator=g)  # replicated
    up_q = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(seed + 2 + rank))  # per rank: its columns
    up_k = torch.randn(2, 3, 3, generator=torch.Generator().manual_seed(seed + 20 + rank))
    results = []
    for m in (unfused, converted):
        xq, xk = x.clone().requires_grad_(), x.clone().requires_grad_()
        q = m.q(xq)
        k = m.k(DTensor.from_local(xk, mesh, [Replicate()], run_check=False))
        assert isinstance(k, DTensor) and not isinstance(q, DTensor)
        ((q * up_q).sum() + (k.to_local() * up_k).sum()).backward()
        results.append((q.detach(), k.to_local().detach(), xq.grad, xk.grad,
                        {n: tp.local_tensor(p.grad) for n, p in m.named_parameters() if p.grad is not None}))
    (q0, k0, gq0, gk0, p0), (q1, k1, gq1, gk1, p1) = results
    for what, got, want in (("q", q1, q0), ("k", k1, k0), ("x grad via q", gq1, gq0), ("x grad via k", gk1, gk0)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} rank {rank}: {m}")
    assert p1.keys() == p0.keys() == {"q.weight", "q.bias", "k.weight"}, p1.keys()
    for name in p0:
        torch.testing.assert_close(p1[name], p0[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert isinstance(converted.q.weight.grad, DTensor), "the weight's gradient must stay a Shard(0) DTensor"
    dist.destroy_process_group(other)


@pytest.mark.parametrize("world", [2, 3])
def test_dtensor_colwise_layers(ranks, world):
    ranks(world).run(dtensor_plan, random.randrange(1 << 30), ["fused", "sequential"][world - 2])


class _ReducedGradFailingOn(torch.autograd.Function):
    """Identity whose backward all-reduces the gradient over `group` (Megatron's copy-to region), or raises on
    `failing` only: its peers would wait in that all_reduce for the group's whole timeout."""

    @staticmethod
    def forward(ctx, x, group, failing):
        ctx.group, ctx.failing = group, failing
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if dist.get_rank(ctx.group) == ctx.failing:
            raise RuntimeError("boom in backward")
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class BackwardFailsOnOneRank(nn.Module):
    def __init__(self, group, failing):
        super().__init__()
        self.group, self.failing = group, failing
        self.weight = nn.Parameter(torch.randn(4, 12))

    def forward(self, x):
        return F.linear(_ReducedGradFailingOn.apply(x, self.group, self.failing), self.weight)


def probe_of_a_backward_that_raises_on_one_rank(rank, world, failing):
    """Every rank raises within the probe bound, naming the module, when its backward raises on one rank only."""
    import datetime

    sub = dist.new_group(list(range(world)), backend="gloo", timeout=datetime.timedelta(minutes=30))
    model = Holder(p=BackwardFailsOnOneRank(sub, failing))
    elapsed = seconds_until_raised_within_probe_bound(
        rank, failing, lambda: replace_column_parallel(model, patterns=["p"], group=sub),
        (ValueError, "cannot replace 'p' (BackwardFailsOnOneRank)",
         "its backward raised RuntimeError: boom in backward", f"on rank {rank}", "at most 3 s"),
        (RuntimeError, f"probing 'p' (BackwardFailsOnOneRank) on rank {rank}", "waited past 3 s",
         "another rank's backward of it probably raised"))
    assert isinstance(model.p, BackwardFailsOnOneRank)  # a failed conversion leaves the model untouched
    assert model.p.weight.requires_grad  # restored after the probe
    dist.barrier()  # the default group: the failing rank waits here until its peers have given up
    dist.destroy_process_group(sub)
    return elapsed


@pytest.mark.parametrize("world,failing", [(2, 0), (3, 2)])
def test_probe_of_a_backward_that_raises_on_one_rank_is_bounded(ranks, world, failing):
    elapsed = ranks(world).run(probe_of_a_backward_that_raises_on_one_rank, failing)
    # Without the bound the waiting ranks would sit in the all_reduce for 30 minutes (the pool's 120 s bound fails
    # the test first).
    assert all(t < 60 for r, t in enumerate(elapsed) if r != failing), elapsed
