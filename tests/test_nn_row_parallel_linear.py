"""RowParallelLinear on real ranks against the full nn.Linear in float64: forward and backward for every algorithm,
world sizes 1-3, inputs of 1 to 4 dims, subgroups; from_linear slicing and state_dict interchange with a plain
sharded nn.Linear."""
import copy
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from inputs import TOLERANCE, assert_matches
from torch_gemm_ar.nn import RowParallelLinear

LEAD_SHAPES = [(13,), (2, 7), (2, 3, 5), ()]


def full_linear(seed: int, in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """The unsharded layer, identical on every rank, with unit-scale random values (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=g, dtype=torch.float64))
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=g, dtype=torch.float64))
    return linear


def check_close(got: torch.Tensor, want: torch.Tensor, dtype, terms: int, what: str):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * (terms ** 0.5 + 1),
                               msg=lambda m: f"{what}: {m}")


def forward_backward_vs_full(rank, world, seed, dtype, algorithm, group_ranks=None):
    group, group_rank, group_world = None, rank, world
    if group_ranks is not None:
        group = dist.new_group(group_ranks)
        if rank not in group_ranks:
            return
        group_rank, group_world = group_ranks.index(rank), len(group_ranks)
    k = 33  # per-rank input features: not a multiple of any tile size
    in_features, out_features = k * group_world, 37
    for case, lead in enumerate(LEAD_SHAPES):
        bias = case % 2 == 0
        full = full_linear(seed + case, in_features, out_features, bias)
        layer = RowParallelLinear.from_linear(copy.deepcopy(full).to(dtype), group, algorithm=algorithm)
        g = torch.Generator().manual_seed(seed + 1000 + case)
        x_full = torch.randn(*lead, in_features, generator=g, dtype=torch.float64)
        upstream = torch.randn(*lead, out_features, generator=g, dtype=torch.float64)
        cols = slice(group_rank * k, (group_rank + 1) * k)

        x = x_full[..., cols].to(dtype).requires_grad_()
        out = layer(x)
        (out * upstream.to(dtype)).sum().backward()
        x_ref = x_full.clone().requires_grad_()
        ref = full(x_ref)
        (ref * upstream).sum().backward()

        what = f"{algorithm} {dtype} lead={lead} bias={bias} rank={rank}"
        assert_matches(out, ref.detach(), dtype, in_features, 1, what + " output")
        check_close(x.grad, x_ref.grad[..., cols], dtype, out_features, what + " grad x")
        rows = max(1, x_full[..., 0].numel())
        check_close(layer.weight.grad, full.weight.grad[:, cols], dtype, rows, what + " grad weight")
        if bias:
            check_close(layer.bias.grad, full.bias.grad, dtype, rows, what + " grad bias")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("algorithm", ["sequential", "chunked", "fused", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_forward_backward_match_full_linear(ranks, world, algorithm, dtype):
    ranks(world).run(forward_backward_vs_full, random.randrange(1 << 30), dtype, algorithm)


def test_world_of_one_is_the_full_linear(ranks):
    ranks(1).run(forward_backward_vs_full, random.randrange(1 << 30), torch.float32, "auto")


def test_subgroup_uses_the_group_rank_slice(ranks):
    # Global ranks 0 and 2 form the group; global rank 2 is group rank 1 and must take the second slice.
    ranks(3).run(forward_backward_vs_full, random.randrange(1 << 30), torch.float32, "sequential", [0, 2])


def state_dict_interchange(rank, world, seed):
    full = full_linear(seed, 5 * world, 11, bias=True).float()
    # One fixed algorithm for the bitwise comparison below (auto may try several while it tunes).
    layer = RowParallelLinear.from_linear(full, algorithm="fused")
    cols = slice(rank * 5, (rank + 1) * 5)
    state = layer.state_dict()
    assert list(state) == ["weight", "bias"], list(state)
    assert torch.equal(state["weight"], full.weight.detach()[:, cols]) and torch.equal(state["bias"], full.bias)
    assert state["weight"].is_contiguous()

    # A plain sharded nn.Linear loads it (strict), and a fresh RowParallelLinear loads the plain one's back.
    plain = nn.Linear(5, 11)
    plain.load_state_dict(state)
    fresh = RowParallelLinear(5 * world, 11, algorithm="fused")
    fresh.load_state_dict(plain.state_dict())
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed + rank))
    torch.testing.assert_close(fresh(x), layer(x), rtol=0, atol=0)

    # from_linear copies: the full layer can change or be freed without touching the shard.
    with torch.no_grad():
        full.weight.add_(1.0)
        full.bias.add_(1.0)
    assert torch.equal(layer.weight, state["weight"]) and torch.equal(layer.bias, state["bias"])

    # requires_grad, dtype and the missing bias carry over.
    frozen = nn.Linear(2 * world, 3, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    shard = RowParallelLinear.from_linear(frozen)
    assert shard.bias is None and list(shard.state_dict()) == ["weight"]
    assert shard.weight.dtype == torch.bfloat16 and not shard.weight.requires_grad
    assert (shard.in_features, shard.out_features, shard.in_features_per_rank) == (2 * world, 3, 2)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_state_dict_matches_a_plain_sharded_linear(ranks, world):
    ranks(world).run(state_dict_interchange, random.randrange(1 << 30))


def fresh_initialisation(rank, world, seed):
    torch.manual_seed(seed)  # the same seed on every rank, the usual setup
    layer = RowParallelLinear(40 * world, 9)
    torch.manual_seed(seed)
    full = nn.Linear(40 * world, 9)
    # This rank's slice of the nn.Linear that the same seed gives, so the scale follows the full fan-in.
    assert layer.weight.shape == (9, 40)
    assert torch.equal(layer.weight, full.weight.detach()[:, rank * 40:(rank + 1) * 40])
    assert torch.count_nonzero(layer.bias) == 0  # zero on every rank: a random bias could differ between ranks
    return layer.weight.sum().item()


def test_fresh_initialisation(ranks):
    sums = ranks(2).run(fresh_initialisation, random.randrange(1 << 30))
    assert sums[0] != sums[1], "ranks should hold different weight shards"
