"""The portable path's agreement exchange (common/rank_agreement.h): over the process group it is one fp32
all_reduce of a fixed size, and a small `sequential` call's partial product rides on it, so such a call is one
collective. Run with the CPU engine turned off (TORCH_GEMM_AR_CPU_ENGINE=0), as on ranks spread over hosts: results
against float64, which calls carry their result, and disagreeing or bad calls still failing on every rank."""
import random

import pytest
import torch
import torch.distributed as dist

import torch_gemm_ar
from expect import raises
from scoped_env import scoped_env
from engine_observation_build import observe

SLOTS = 16384  # kAgreementPayloadSlots


def portable_group(world):
    """A fresh group whose engine is off (the variable is read when the group's engine is set up)."""
    with scoped_env(TORCH_GEMM_AR_CPU_ENGINE="0"):
        group = dist.new_group(list(range(world)))
        torch_gemm_ar.gemm_allreduce(torch.ones(1, 1), torch.ones(1, 1), group, algorithm="sequential")
    return group


def reference(seed, world, m, k, n, dtype, bias, three_d):
    g = torch.Generator().manual_seed(seed)
    shape = (2, m // 2, k) if three_d else (m, k)
    shards = [torch.randn(*shape, generator=g).to(dtype) for _ in range(world)]
    weights = [torch.randn(k, n, generator=g).to(dtype) for _ in range(world)]
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = sum(s.double() @ w.double() for s, w in zip(shards, weights))
    if b is not None:
        want = want + b.double()
    return shards, weights, b, want


def carried_results(rank, world, seed):
    group = portable_group(world)
    cases = [(1, 7, 33, torch.float32, False, False), (3, 5, 101, torch.bfloat16, True, False),
             (4, 9, 2051, torch.float16, True, True), (1, 3, SLOTS, torch.float32, True, False),
             (2, 4, SLOTS // 2 + 1, torch.float32, False, False),   # M*N one past the slots: a second collective
             (5, 6, 17, torch.float64, True, False)]                # fp64 never rides (fp32 slots)
    for i, (m, k, n, dtype, bias, three_d) in enumerate(cases):
        shards, weights, b, want = reference(seed + i, world, m, k, n, dtype, bias, three_d)
        for algorithm in ("sequential", "auto"):
            before = observe.agreement_payload_calls()
            partials = observe.sequential_partial_calls()
            got = torch_gemm_ar.gemm_allreduce(shards[rank], weights[rank], group, bias=b, algorithm=algorithm)
            carried = observe.agreement_payload_calls() - before
            if algorithm == "sequential":  # its product computed once, carried or not
                assert observe.sequential_partial_calls() - partials == 1
            assert got.dtype == dtype and got.shape == want.shape
            tol = {torch.float32: 1e-4, torch.float64: 1e-10, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
            err = (got.double() - want).abs().max().item() / (want.abs().max().item() + 1)
            assert err <= tol, f"case {i} {algorithm}: relative error {err:.3g} > {tol}"
            fits = m * n <= SLOTS and dtype != torch.float64
            if algorithm == "sequential":
                assert carried == (1 if fits else 0), f"case {i}: carried {carried}, expected {int(fits)}"
    dist.destroy_process_group(group)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_small_sequential_calls_ride_on_the_agreement(ranks, world):
    ranks(world).run(carried_results, random.randrange(1 << 30))


def disagreements(rank, world):
    group = portable_group(world)
    a, b = torch.randn(2, 8), torch.randn(8, 5 + (rank == 1))
    # Different N on one rank (both small): every rank raises, none uses the summed slots.
    raises(lambda: torch_gemm_ar.gemm_allreduce(a, b, group, algorithm="sequential"), "disagree on N",
           exc=ValueError)
    # One rank's output fits the slots, the other's does not: the exchange still has one size everywhere.
    m = 2 if rank == 0 else 4000
    raises(lambda: torch_gemm_ar.gemm_allreduce(torch.randn(m, 8), torch.randn(8, 9), group, algorithm="sequential"),
           "disagree on M", exc=ValueError)
    # A rank with a bad argument: its peers learn it from the same exchange.
    bias = torch.randn(7) if rank == 1 else None
    raises(lambda: torch_gemm_ar.gemm_allreduce(torch.randn(2, 8), torch.randn(8, 5), group, bias=bias,
                                                algorithm="sequential"), exc=ValueError)
    # And the group still works.
    out = torch_gemm_ar.gemm_allreduce(torch.ones(2, 8), torch.ones(8, 5), group, algorithm="sequential")
    assert torch.equal(out, torch.full((2, 5), 8.0 * world))
    raises(lambda: torch_gemm_ar.gemm_allreduce(torch.ones(2, 8), torch.ones(8, 5), group, algorithm="fused"),
           "TORCH_GEMM_AR_CPU_ENGINE=0")
    dist.destroy_process_group(group)


@pytest.mark.parametrize("world", [2, 3])
def test_disagreeing_and_bad_calls_fail_everywhere(ranks, world):
    ranks(world).run(disagreements)


def engine_sequential_computes_once(rank, world, seed):
    """With the CPU engine (one host) the agreement goes through the shared windows, which carry no data: a small
    sequential call must not compute its product for a payload that nothing carries, then again for its
    all_reduce (it did: every small sequential call on one host ran its GEMM twice)."""
    group = dist.new_group(list(range(world)))
    for i, (m, k, n) in enumerate([(1, 7, 33), (3, 64, 512), (16, 1792, 512)]):
        shards, weights, b, want = reference(seed + i, world, m, k, n, torch.float32, True, False)
        partials = observe.sequential_partial_calls()
        carried = observe.agreement_payload_calls()
        got = torch_gemm_ar.gemm_allreduce(shards[rank], weights[rank], group, bias=b, algorithm="sequential")
        assert observe.sequential_partial_calls() - partials == 1, (m, k, n)
        assert observe.agreement_payload_calls() == carried
        err = (got.double() - want).abs().max().item() / (want.abs().max().item() + 1)
        assert err <= 1e-4, err
    dist.destroy_process_group(group)


@pytest.mark.parametrize("world", [2, 3])
def test_small_sequential_calls_on_the_engine_compute_once(ranks, world):
    ranks(world).run(engine_sequential_computes_once, random.randrange(1 << 30))
