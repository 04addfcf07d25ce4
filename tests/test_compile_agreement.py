"""The compile rewrite's rank agreement (torch_gemm_ar/compile/agreement.py) on real ranks.

A model that graph-breaks on rank 0 only (a rank-0-only warning between a GEMM and its all-reduce, as Megatron-core
warns) compiles and runs correctly: the site rank 0 does not have keeps its plain all-reduce on every rank, the site
every rank has is still fused, and report() says which rank was missing. A model whose ranks trace alike has every
site fused and leaves no agreement keys in the store. The negative control bypasses the agreement in the ranks: the
same divergent model must then fail within a short bound (the fused op on rank 1 meets a plain all-reduce on rank 0).
After a disagreement, reset() on every rank starts the agreement afresh; between ranks the pass has no Inductor
cache key. The bound is set low here (TORCH_GEMM_AR_COMPILE_AGREE_S=2) so that the waits cost little.
"""
import random
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torch_gemm_ar
from inputs import TOLERANCE, shard
from scoped_env import scoped_env

AGREE_S = "2"
M, K, F, N = 7, 33, 20, 13  # odd sizes, not multiples of any tile


class TwoRowParallelLayers(nn.Module):
    """x @ w1 -> all-reduce -> relu -> @ w2 -> all-reduce, with functional collectives (each rank its own shards).
    `warns`: this rank warns between the first GEMM and its all-reduce, so its dynamo graph-breaks there."""

    def __init__(self, w1, w2, group_name, warns):
        super().__init__()
        self.w1, self.w2, self.group_name, self.warns = w1, w2, group_name, warns

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        h = x @ self.w1
        if self.warns:
            warnings.warn("a warning on one rank only", stacklevel=1)
        h = funcol.all_reduce(h, "sum", self.group_name)
        return funcol.all_reduce(torch.relu(h) @ self.w2, "sum", self.group_name)


def _shards(seed, rank):
    return (shard(seed, rank, M, K, torch.float32), shard(seed + 1, rank, K, F, torch.float32),
            shard(seed + 2, rank, F, N, torch.float32))


def _exact(seed, world):
    parts = [[t.double() for t in _shards(seed, r)] for r in range(world)]
    h = sum(x @ w1 for x, w1, _ in parts)
    return sum(torch.relu(h) @ w2 for _, _, w2 in parts)


def compiled_two_layers(rank, world, seed, warn_rank, bypass_agreement=False):
    """Compile and run the model twice; returns report()'s rewritten and skipped counts, the compiled graphs' code,
    the largest error vs float64 and difference from the uncompiled model, and the store keys the second compile
    left."""
    from torch.distributed.distributed_c10d import _world

    from torch_gemm_ar.compile import agreement

    torch._dynamo.reset()
    if bypass_agreement:  # negative control: every rank rewrites whatever it has, as before the agreement
        agreement_fn, agreement.agree = agreement.agree, lambda sites: [None] * len(sites)
    x, w1, w2 = _shards(seed, rank)
    model = TwoRowParallelLayers(w1, w2, dist.group.WORLD.group_name, warns=rank == warn_rank)
    graphs = []

    def recording_inner(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    store = _world.pg_map[dist.group.WORLD][1]
    try:
        with scoped_env(TORCH_GEMM_AR_COMPILE_AGREE_S=AGREE_S), warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            errors, diffs, keys = [], [], []
            for attempt in range(2):  # the second compile shows whether the first left keys behind
                torch._dynamo.reset()
                torch_gemm_ar.compile.reset()
                graphs.clear()
                dist.barrier()
                keys_before = store.num_keys()
                compiled = torch.compile(model, backend=torch_gemm_ar.compile.backend(inner=recording_inner))
                got, eager = compiled(x), model(x)
                dist.barrier()
                keys.append(store.num_keys() - keys_before)
                errors.append((got.double() - _exact(seed, world)).abs().max().item())
                diffs.append((got - eager).abs().max().item())
    finally:
        if bypass_agreement:
            agreement.agree = agreement_fn
    report = torch_gemm_ar.compile.report()
    return dict(report.rewritten), dict(report.skipped), list(graphs), max(errors), max(diffs), keys[1]


def _tolerance(seed, world):
    return TOLERANCE[torch.float32] * (_exact(seed, world).abs().max().item() + 1.0)


@pytest.mark.parametrize("world", [2, 3])
def test_rank0_only_graph_break_compiles_and_runs(ranks, world):
    seed = random.randrange(1 << 30)
    results = ranks(world).run(compiled_two_layers, seed, 0, timeout_s=120)
    for rank, (rewritten, skipped, graphs, error, diff, leftover) in enumerate(results):
        code = "\n".join(graphs)
        assert error <= _tolerance(seed, world) and diff <= _tolerance(seed, world), (rank, error, diff)
        # The second site is whole on every rank: fused everywhere. The first keeps its all-reduce on every rank.
        assert rewritten == {"gemm_allreduce": 1}, (rank, rewritten, skipped)
        assert code.count("pto.gemm_allreduce") == 1 and code.count("_c10d_functional.all_reduce") == 1, code
        if rank == 0:
            assert not any("not rewritten" in reason for reason in skipped), skipped
        else:
            reasons = " ".join(skipped)
            assert "not rewritten: rank(s) [0] of group" in reasons and "TORCH_GEMM_AR_COMPILE_AGREE_S" in reasons, \
                skipped
        # A disagreement leaves at most one set of keys per missing site and compile (counter, outcome, done,
        # the ranks that came).
        assert leftover <= 3 + world, leftover


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_trace_alike_fuse_every_site(ranks, world):
    seed = random.randrange(1 << 30)
    results = ranks(world).run(compiled_two_layers, seed, None, timeout_s=120)
    for rank, (rewritten, skipped, graphs, error, diff, leftover) in enumerate(results):
        assert error <= _tolerance(seed, world) and diff <= _tolerance(seed, world), (rank, error, diff)
        assert rewritten == {"gemm_allreduce": 2}, (rank, rewritten, skipped)
        code = "\n".join(graphs)
        assert code.count("pto.gemm_allreduce") == 2 and "_c10d_functional.all_reduce" not in code, code
        assert leftover == 0, f"rank {rank}: the agreements left {leftover} store keys behind"


def divergent_then_alike(rank, world, seed):
    """After a compile that rank 0 split: the same sites compiled alike stay unfused until reset() on every rank
    (the ranks' counts of them differ), and are fused after it. Returns the reports of the two alike compiles."""
    from torch_gemm_ar.compile import agreement

    compiled_two_layers(rank, world, seed, 0)  # resets before compiling, as every call of it does
    x, w1, w2 = _shards(seed, rank)
    model = TwoRowParallelLayers(w1, w2, dist.group.WORLD.group_name, warns=False)
    reports = []
    with scoped_env(TORCH_GEMM_AR_COMPILE_AGREE_S=AGREE_S), torch.no_grad():
        for restart in (False, True):
            torch._dynamo.reset()
            if restart:
                torch_gemm_ar.compile.reset()
            else:  # only the counts of report(); the agreement's session goes on
                torch_gemm_ar.compile._total.rewritten.clear()
                torch_gemm_ar.compile._total.skipped.clear()
            assert agreement.bound_s() == float(AGREE_S)
            compiled = torch.compile(model, backend=torch_gemm_ar.compile.backend(inner="eager"))
            error = (compiled(x).double() - _exact(seed, world)).abs().max().item()
            assert error <= _tolerance(seed, world), (rank, restart, error)
            report = torch_gemm_ar.compile.report()
            reports.append((dict(report.rewritten), " ".join(report.skipped)))
    return reports


def test_reset_on_every_rank_starts_the_agreement_afresh(ranks):
    for rank, (without_reset, with_reset) in enumerate(ranks(2).run(divergent_then_alike, random.randrange(1 << 30))):
        # The site every rank had before is fused again; the one rank 0 lacked is not, and the reason says why.
        assert without_reset[0] == {"gemm_allreduce": 1}, (rank, without_reset)
        assert "an earlier compile of this site" in without_reset[1] or "did not compile this site" in \
            without_reset[1], (rank, without_reset)
        assert with_reset[0] == {"gemm_allreduce": 2}, (rank, with_reset)


def test_negative_control_without_agreement_fails_fast():
    """Without the agreement rank 1 fuses the first site while rank 0 runs its plain all-reduce: rank 1's fused op
    gives up after TORCH_GEMM_AR_TIMEOUT_S, and rank 0, stuck in gloo's all-reduce, is ended by the pool's bound."""
    from rank_pool import RankFailure, RankPool

    with scoped_env(TORCH_GEMM_AR_TIMEOUT_S="3"):
        pool = RankPool(2)
    try:
        with pytest.raises(RankFailure) as failure:
            pool.run(compiled_two_layers, random.randrange(1 << 30), 0, bypass_agreement=True,
                     timeout_s=20)
    finally:
        pool.close(force=True)
    text = str(failure.value)
    assert "rank(s) 0 did not arrive" in text and "ranks [0] did not answer" in text, text


def test_the_bound_is_checked(monkeypatch):
    from torch_gemm_ar.compile import agreement

    monkeypatch.delenv(agreement.ENV, raising=False)
    assert agreement.bound_s() == agreement.DEFAULT_S
    monkeypatch.setenv(agreement.ENV, "0.5")
    assert agreement.bound_s() == 0.5
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv(agreement.ENV, bad)
        with pytest.raises(ValueError, match=agreement.ENV):
            agreement.bound_s()


def pass_cache_key(rank, world):
    return torch_gemm_ar.compile.GemmCollectivePass().uuid()


def test_inductor_caches_are_bypassed_between_ranks(ranks):
    """Between ranks the pass has no cache key (a cached graph would carry another run's agreement to one rank);
    in one process it keeps one (tests/test_compile_rewrite.py::test_enable_chains_and_disable_restores)."""
    assert ranks(2).run(pass_cache_key) == [None, None]
