"""Benchmark inputs: a few independent random input sets per shape, rotated between iterations so that caches never
hold the next call's operands, and the float64 reference of the first set. Every rank rebuilds every rank's shard
from the seed, so each rank checks its own result without extra communication."""
from dataclasses import dataclass
from typing import List, Optional

import torch


@dataclass
class InputSet:
    a: torch.Tensor  # [M, K], this rank's shard
    b: torch.Tensor  # [K, N] = weight.t() of an [N, K] nn.Linear weight (not contiguous, as in a real layer)
    bias: Optional[torch.Tensor]  # [N] or None


def _generator(seed: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + stream)


def _shard(seed: int, set_index: int, rank: int, m: int, k: int, dtype) -> torch.Tensor:
    # float32 draws, then rounded to dtype: the reference sees exactly the values the op sees.
    return torch.randn(m, k, generator=_generator(seed, 7919 * set_index + rank + 1)).to(dtype)


def _weight(seed: int, set_index: int, k: int, n: int, dtype) -> torch.Tensor:
    return torch.randn(n, k, generator=_generator(seed, 7919 * set_index + 5003)).to(dtype).t()


def _bias(seed: int, set_index: int, n: int, dtype) -> torch.Tensor:
    return torch.randn(n, generator=_generator(seed, 7919 * set_index + 6007)).to(dtype)


def make_sets(seed: int, count: int, rank: int, m: int, k: int, n: int, dtype, with_bias: bool,
              device) -> List[InputSet]:
    sets = []
    for i in range(count):
        sets.append(InputSet(
            a=_shard(seed, i, rank, m, k, dtype).to(device),
            b=_weight(seed, i, k, n, dtype).to(device),
            bias=_bias(seed, i, n, dtype).to(device) if with_bias else None,
        ))
    return sets


@dataclass
class References:
    """float64 results for input set 0: what each kind of row must return."""
    reduced: torch.Tensor  # sum over ranks of a_r @ b, plus bias once
    reduced_no_bias: torch.Tensor  # sum over ranks of a_r @ b
    local: torch.Tensor  # this rank's a @ b plus bias (what a GEMM without communication returns)


def make_references(seed: int, world: int, rank: int, m: int, k: int, n: int, dtype, with_bias: bool) -> References:
    b = _weight(seed, 0, k, n, dtype).double()
    products = [_shard(seed, 0, r, m, k, dtype).double() @ b for r in range(world)]
    reduced_no_bias = torch.stack(products).sum(0) if world > 1 else products[0]
    bias = _bias(seed, 0, n, dtype).double() if with_bias else torch.zeros(n, dtype=torch.float64)
    return References(reduced=reduced_no_bias + bias, reduced_no_bias=reduced_no_bias, local=products[rank] + bias)
