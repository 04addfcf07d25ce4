"""Bad uses of RowParallelLinear and of replace_row_parallel on plain (non-DTensor) models: every rank raises an error
that says what is wrong, a failed conversion leaves the model untouched, and the group stays usable (except after a
layer whose forward raised on one rank only during the probe: a collective was abandoned there, as any would be).
(DTensor refusals are in test_nn_dtensor.py.)"""
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
from torch_gemm_ar.nn import RowParallelLinear  # noqa: E402
from expect import raises, seconds_until_raised_within_probe_bound


def _all_reduce(t, group):
    out = t.clone()
    dist.all_reduce(out, group=group)
    return out


class ReducesOver(nn.Module):
    """A Megatron-style row-parallel layer (matmul, all_reduce over `group`, bias once), for a chosen group."""

    def __init__(self, in_local, out_features, group, bias=True):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.randn(out_features, in_local))
        self.bias = nn.Parameter(torch.randn(out_features)) if bias else None

    def forward(self, x):
        out = _all_reduce(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias


class BiasOnEveryRank(ReducesOver):
    def forward(self, x):
        return _all_reduce(F.linear(x, self.weight, self.bias), self.group)


class ReturnsOutputAndBias(ReducesOver):
    """Megatron-LM's and vLLM's return convention, which a tensor-returning layer cannot stand in for."""

    def forward(self, x):
        return _all_reduce(F.linear(x, self.weight), self.group), self.bias


class Holder(nn.Module):
    def __init__(self, **children):
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)


def layer_misuse(rank, world):
    raises(lambda: RowParallelLinear(3 * world + 1, 4), "in_features=", "not divisible", exc=ValueError)
    raises(lambda: RowParallelLinear.from_linear(nn.Linear(3 * world + 1, 4)), "not divisible", exc=ValueError)
    raises(lambda: RowParallelLinear.from_linear(nn.Conv1d(2, 2, 1)), "expected an nn.Linear", "Conv1d",
           exc=TypeError)
    raises(lambda: RowParallelLinear(2 * world, 4, algorithm="fastest"), "algorithm must be one of", exc=ValueError)
    raises(lambda: RowParallelLinear(2 * world, 4, group=3), "group must be a ProcessGroup", exc=TypeError)
    raises(lambda: RowParallelLinear(2 * world, 4, group="no-such-group"), "no-such-group", exc=ValueError)
    layer = RowParallelLinear(2 * world, 4)
    raises(lambda: layer(torch.randn(5, 2 * world)), "this rank's shard", "= 2;", exc=ValueError)
    sub = dist.new_group([0, 1])
    if rank == 2:
        raises(lambda: RowParallelLinear(4, 4, group=sub), "is not a member of the group", exc=ValueError)
    else:
        assert RowParallelLinear(4, 4, group=sub).world_size == 2
    dist.destroy_process_group(sub)
    out = layer(torch.ones(3, 2))
    assert out.shape == (3, 4)


def test_row_parallel_linear_misuse(ranks):
    ranks(3).run(layer_misuse)


def test_needs_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("this process already has a default group")
    raises(lambda: RowParallelLinear(4, 4), "init_process_group", exc=RuntimeError)


def converter_misuse(rank, world, seed):
    torch.manual_seed(seed + rank)
    convert = torch_gemm_ar.nn.replace_row_parallel
    k, n = 6, 5
    world_group = dist.group.WORLD

    # A bare nn.Linear shard: its all_reduce lives in the parent, which the converter cannot remove.
    model = Holder(o_proj=nn.Linear(k, n, bias=False))
    raises(lambda: convert(model, patterns=["o_proj"]), "'o_proj'", "partial product", "RowParallelLinear",
           exc=ValueError)
    assert type(model.o_proj) is nn.Linear, "a failed call must leave the model untouched"

    # Column-parallel layers, norms and whole blocks are not row-parallel linear layers.
    block = tp.tensor_parallel_plain(tp.make_block(tp.BlockConfig(hidden=12, heads=3, ffn=9), seed), world_group)
    raises(lambda: convert(block, patterns=["*.q_proj"]), "'self_attn.q_proj'", "column-parallel", exc=ValueError)
    raises(lambda: convert(block, patterns=["input_layernorm"]), "1-D", "expected a 2-D", exc=ValueError)
    raises(lambda: convert(block, patterns=["mlp"]), "not a single linear layer", exc=ValueError)
    raises(lambda: convert(block, patterns=["*.o_proj", "*.up_proj"]), "'mlp.up_proj'", exc=ValueError)
    assert type(block.self_attn.o_proj) is tp.UnfusedRowParallelLinear, "nothing replaced after a failure"

    # Layers that reduce but do not compute what the fused layer computes.
    raises(lambda: convert(Holder(p=BiasOnEveryRank(k, n, world_group)), patterns=["p"]),
           "bias on every rank", f"({world} times", exc=ValueError)
    raises(lambda: convert(Holder(p=ReturnsOutputAndBias(k, n, world_group)), patterns=["p"]), "returns tuple",
           exc=ValueError)
    hooked = ReducesOver(k, n, world_group)
    hooked.register_forward_pre_hook(lambda mod, inputs: None)
    raises(lambda: convert(Holder(p=hooked), patterns=["p"]), "hooks", exc=ValueError)
    buffered = ReducesOver(k, n, world_group)
    buffered.register_buffer("scale", torch.ones(1))
    raises(lambda: convert(Holder(p=buffered), patterns=["p"]), "buffers ['scale']", exc=ValueError)

    # Ranks whose shards disagree: reported on every rank, before anything is probed.
    uneven = ReducesOver(k + (rank == 1), n, world_group)
    raises(lambda: convert(Holder(p=uneven), patterns=["p"]), "ranks disagree on its shapes", exc=ValueError)

    # Wrong group, two ways. Ranks {0, 1} and {2} are the tensor-parallel groups.
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2])]
    my_tp_group = tp_groups[0] if rank < 2 else tp_groups[1]
    # (1) the layer reduces over its TP group but the whole world is passed: ranks see different things.
    raises(lambda: convert(Holder(p=ReducesOver(k, n, my_tp_group)), patterns=["p"]), "ranks disagree",
           "is the group right?", exc=ValueError)
    # (2) the layer reduces over the world but the TP group is passed.
    raises(lambda: convert(Holder(p=ReducesOver(k, n, world_group)), group=my_tp_group, patterns=["p"]),
           "wrong group", exc=ValueError)
    # ... and with the right group it converts.
    right = Holder(p=ReducesOver(k, n, my_tp_group))
    assert convert(right, group=my_tp_group, patterns=["p"]) == ["p"]
    assert isinstance(right.p, RowParallelLinear) and right.p.world_size == (2 if rank < 2 else 1)

    # Patterns and arguments.
    raises(lambda: convert(block, patterns=["*.out_proj"]), "['*.out_proj']", "match no module", exc=ValueError)
    raises(lambda: convert(block, patterns=[]), "non-empty", exc=ValueError)
    raises(lambda: convert(block, patterns=tp.ROW_PARALLEL_PATTERNS, algorithm="fastest"), "algorithm must be one of",
           exc=ValueError)
    raises(lambda: convert(block), "no module parallelized with RowwiseParallel", "patterns=", exc=ValueError)

    # The group still works after all of that.
    out = torch_gemm_ar.gemm_allreduce(torch.ones(2, 3), torch.ones(3, 4), algorithm="sequential")
    torch.testing.assert_close(out, torch.full((2, 4), 3.0 * world))
    for group in tp_groups:
        dist.destroy_process_group(group)


def test_converter_misuse_raises_on_every_rank(ranks):
    ranks(3).run(converter_misuse, random.randrange(1 << 30))


def shared_and_repeated(rank, world, seed):
    """A layer reachable under two names is converted once and replaced under both; a second call is a no-op."""
    torch.manual_seed(seed)
    shared = ReducesOver(4, 3, dist.group.WORLD)
    model = Holder(first=shared, second=shared)
    assert torch_gemm_ar.nn.replace_row_parallel(model, patterns="*") == ["first", "second"]
    assert model.first is model.second and isinstance(model.first, RowParallelLinear)
    assert torch_gemm_ar.nn.replace_row_parallel(model, patterns="*") == []


def test_shared_module_and_repeated_call(ranks):
    ranks(2).run(shared_and_repeated, random.randrange(1 << 30))


class RaisesOnOneRank(ReducesOver):
    """A row-parallel layer whose forward raises on one rank only, before its all_reduce: its peers would wait in
    that all_reduce for the group's whole timeout."""

    def __init__(self, in_local, out_features, group, failing_rank):
        super().__init__(in_local, out_features, group)
        self.failing_rank = failing_rank

    def forward(self, x):
        if dist.get_rank(self.group) == self.failing_rank:
            raise RuntimeError("boom")
        return super().forward(x)


def probe_of_a_forward_that_raises_on_one_rank(rank, world, failing):
    """Every rank raises within the probe bound, naming the module; the group's own timeout (30 minutes, gloo's
    default) is restored after a probe that passed."""
    def timeout_of(group):
        return group._get_backend(torch.device("cpu")).options._timeout

    import datetime

    sub = dist.new_group(list(range(world)), backend="gloo", timeout=datetime.timedelta(minutes=30))
    good = Holder(p=ReducesOver(2, 3, sub))
    assert torch_gemm_ar.nn.replace_row_parallel(good, patterns="p", group=sub) == ["p"]
    assert timeout_of(sub) == datetime.timedelta(minutes=30)

    model = Holder(p=RaisesOnOneRank(2, 3, sub, failing))
    elapsed = seconds_until_raised_within_probe_bound(
        rank, failing, lambda: torch_gemm_ar.nn.replace_row_parallel(model, patterns="p", group=sub),
        (ValueError, "cannot replace 'p' (RaisesOnOneRank)", "raised RuntimeError: boom on rank", "at most 3 s"),
        (RuntimeError, f"probing 'p' (RaisesOnOneRank) on rank {rank}", "waited past 3 s",
         "another rank's forward of it probably raised"))
    assert isinstance(model.p, RaisesOnOneRank)  # a failed conversion leaves the model untouched
    dist.barrier()  # the default group: the failing rank waits here until its peers have given up
    dist.destroy_process_group(sub)
    return elapsed


@pytest.mark.parametrize("world,failing", [(2, 1), (3, 0)])
def test_probe_of_a_forward_that_raises_on_one_rank_is_bounded(ranks, world, failing):
    elapsed = ranks(world).run(probe_of_a_forward_that_raises_on_one_rank, failing)
    waiting = [t for r, t in enumerate(elapsed) if r != failing]
    # Without the bound the waiting ranks would sit in the all_reduce for 30 minutes (the pool's 120 s bound fails
    # the test first).
    assert all(t < 60 for t in waiting), elapsed


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "1e9", "soon"])
def test_probe_timeout_setting_is_validated(monkeypatch, value):
    from torch_gemm_ar.nn._probe_timeout import probe_timeout_s

    monkeypatch.setenv("TORCH_GEMM_AR_PROBE_TIMEOUT_S", value)
    raises(probe_timeout_s, "TORCH_GEMM_AR_PROBE_TIMEOUT_S", repr(value), exc=ValueError)
    monkeypatch.setenv("TORCH_GEMM_AR_PROBE_TIMEOUT_S", "7.5")
    assert probe_timeout_s() == 7.5
