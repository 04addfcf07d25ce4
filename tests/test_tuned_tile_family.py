"""`auto` also times fused with the tile family the CPU engine's geometry rules did not pick (`fused/tiles` or
`fused/few-products`; the rules were measured on one CPU): the candidate appears where the two configurations differ,
every rank decides alike, the decided family is the one that runs and its results are right, the decision comes back
from the tune cache, and the switch that turns it off removes the candidate."""
import os
import random

import pytest
import torch

from scoped_env import scoped_env
from test_auto_tuner import checked_auto_call, fresh_tuner
from torch_gemm_ar import _C, tuning
from engine_observation_build import observe

# The engine as on a one-core rank (what the rules and these counts assume), whatever this host's core count.
ONE_CORE = dict(TORCH_GEMM_AR_COMPUTE_THREADS="1", TORCH_GEMM_AR_COMM_THREADS="0")

# fp32 output over the one-shot limit (8 MiB): a decided few-product call runs as one product, which is counted.
M, K, N = 2048, 256, 1024
SLOW_US = 150_000  # added to every tuning run of the candidates that must lose: far beyond the noise of a run


def other_family(dtype, m=M, k=K, n=N, world=2):
    assert os.environ.get("TORCH_GEMM_AR_CPU_TILE") is None  # a tile from the environment hides the families
    with scoped_env(**ONE_CORE):
        return observe.other_tile_family(m, k, n, torch.empty(0, dtype=dtype), world)


def test_the_candidate_is_the_family_the_rules_did_not_pick(one_core_env):
    f32, bf16 = torch.empty(0), torch.empty(0, dtype=torch.bfloat16)
    assert observe.other_tile_family(2048, 1024, 1024, f32, 2) == "fused/few-products"  # rules: default tiles
    assert observe.other_tile_family(1024, 4096, 1024, f32, 2) == "fused/tiles"  # long K: rules take few products
    # Where bf16 products reorder B per call (computed natively), the rules take few products; else as fp32.
    native = observe.reorders_b_per_product(bf16)
    assert observe.other_tile_family(2048, 1024, 1024, bf16, 2) == ("fused/tiles" if native else "fused/few-products")
    assert observe.other_tile_family(100, 40, 90, f32, 2) == ""  # tiny outputs: tiles cannot matter enough
    assert observe.other_tile_family(8, 4096, 4096, f32, 3) == ""


def tune_with(rank, world, seed, cache_path, dtype, slow, calls_after):
    """Tunes the bucket with `slow` ("!name": every candidate but that one) slowed, then runs `calls_after` decided
    calls. Returns the decision, this bucket's looked-up choice, and how many of the decided calls ran as one
    product (the few-product family; the default tiles never do)."""
    with scoped_env(**ONE_CORE):
        fresh_tuner(cache_path)
        _C._set_tuner_slow_candidate(slow, SLOW_US)
        try:
            tuning.warm_up_until_tuned(lambda: checked_auto_call(rank, world, seed, M, K, N, dtype))
        finally:
            _C._set_tuner_slow_candidate("", 0)
        before = observe.one_product_calls()
        for i in range(calls_after):
            checked_auto_call(rank, world, seed + 1 + i, M, K, N, dtype)
        one_products = observe.one_product_calls() - before
        return tuning.decisions(), tuning.decision_for(M, K, N, dtype), one_products


def check_decided(results, family, calls_after):
    decisions = [d for d, _, _ in results]
    assert all(len(d) == 1 for d in decisions), decisions
    first = decisions[0][0]
    assert {d[0]["algorithm"] for d in decisions} == {first["algorithm"]}, decisions  # alike on every rank
    assert set(first["candidate_us"]) >= {"fused", family, "sequential"}, first
    for _, looked_up, one_products in results:
        assert looked_up == first["algorithm"]
        if first["algorithm"] == "fused/few-products":
            assert one_products == calls_after  # the family that was decided is the one that ran
        elif first["algorithm"] == "fused/tiles":
            assert one_products == 0
    return first["algorithm"]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_faster_family_is_decided_and_runs(hooked_ranks, tmp_path, world, dtype):
    family = other_family(dtype, world=world)
    assert family, "the test shape must have another tile family"
    results = hooked_ranks(world).run(tune_with, random.randrange(1 << 20), str(tmp_path / "tune.json"), dtype,
                                      "!" + family, 3)
    assert check_decided(results, family, 3) == family


def test_negative_control_a_slow_family_is_not_decided(hooked_ranks, tmp_path):
    """The check above can fail: slowed instead, the other family loses."""
    family = other_family(torch.float32)
    results = hooked_ranks(2).run(tune_with, random.randrange(1 << 20), str(tmp_path / "tune.json"), torch.float32,
                                  family, 2)
    assert check_decided(results, family, 2) != family


def decided_then_cached(rank, world, seed, cache_path, family):
    with scoped_env(**ONE_CORE):
        fresh_tuner(cache_path)
        _C._set_tuner_slow_candidate("!" + family, SLOW_US)
        try:
            tuning.warm_up_until_tuned(lambda: checked_auto_call(rank, world, seed, M, K, N))
        finally:
            _C._set_tuner_slow_candidate("", 0)
        observe.tuner_clear_memory()  # a new process, as far as the tuner knows: the decision comes from the file
        before = observe.one_product_calls()
        for i in range(2):
            checked_auto_call(rank, world, seed + 1 + i, M, K, N)
        return tuning.decisions(), observe.one_product_calls() - before


def test_a_decided_family_comes_back_from_the_tune_cache(hooked_ranks, tmp_path):
    family = other_family(torch.float32)
    cache = str(tmp_path / "tune.json")
    results = hooked_ranks(2).run(decided_then_cached, random.randrange(1 << 20), cache, family)
    for decisions, one_products in results:
        assert [(d["algorithm"], d["source"]) for d in decisions] == [(family, "cache")], decisions
        assert one_products == (2 if family == "fused/few-products" else 0)
    with open(cache) as f:
        assert f'"{family}"' in f.read()


def without_the_family(rank, world, seed, cache_path):
    previous = _C._set_engine_option("tune_tile_family", False)
    try:
        with scoped_env(**ONE_CORE):
            fresh_tuner(cache_path)
            tuning.warm_up_until_tuned(lambda: checked_auto_call(rank, world, seed, M, K, N))
            return tuning.decisions()
    finally:
        _C._set_engine_option("tune_tile_family", previous)


def test_the_switch_removes_the_candidate(ranks, tmp_path):
    results = ranks(2).run(without_the_family, random.randrange(1 << 20), str(tmp_path / "tune.json"))
    for decisions in results:
        assert set(decisions[0]["candidate_us"]) == {"fused", "sequential", "chunked"}, decisions


def first_call_decides_nothing_about_the_candidates(rank, world, seed, cache_path, first_m):
    """A bucket's candidates follow from the bucket (its largest M), not from whichever of its calls came first."""
    with scoped_env(**ONE_CORE):
        fresh_tuner(cache_path)
        tuning.warm_up_until_tuned(lambda: checked_auto_call(rank, world, seed, first_m, K, 100))
        return set(tuning.decisions()[0]["candidate_us"])


def test_a_buckets_candidates_do_not_depend_on_its_first_call(ranks, tmp_path):
    # M 513..1024 with N = 100: 51,300 output elements at M = 513 (under the 64K of other_tile_family), 102,400 at the
    # bucket's M = 1024.
    family = other_family(torch.float32, m=1024, n=100)
    assert family and other_family(torch.float32, m=513, n=100) == ""
    seen = [ranks(2).run(first_call_decides_nothing_about_the_candidates, random.randrange(1 << 20),
                         str(tmp_path / f"tune{m}.json"), m) for m in (513, 1024)]
    assert all(family in candidates for per_rank in seen for candidates in per_rank), seen


def switch_differs(rank, world, option):
    previous = _C._set_engine_option(option, rank != 0)
    try:
        with scoped_env(**ONE_CORE):
            fresh_tuner(os.path.join("/tmp", f"unused-{os.getpid()}.json"))
            checked_auto_call(rank, world, 3, M, K, N)
            return None
    except ValueError as e:
        return str(e)
    finally:
        _C._set_engine_option(option, previous)
        observe.tuner_clear_memory()


@pytest.mark.parametrize("option", ["tune_tile_family", "wide_row_panels", "one_product"])
def test_ranks_that_differ_in_a_geometry_option_get_an_error_not_a_hang(ranks, option):
    """A tuning run of a forced tile family takes a configuration the agreement does not compare field by field: the
    options it depends on (and the one that adds the candidate) are agreed on instead."""
    for message in ranks(2).run(switch_differs, option, timeout_s=120):
        assert message is not None and ("options" in message or "tile" in message), message


def bad_algorithm(rank, world):
    import torch_gemm_ar

    try:
        torch_gemm_ar.gemm_allreduce(torch.ones(4, 3), torch.ones(3, 5), algorithm="fused/tiles")
    except ValueError as e:
        return str(e)
    return None


def test_tuned_names_are_not_algorithm_values(ranks):
    """The families are `auto`'s own candidates: `algorithm=` keeps its four names."""
    for message in ranks(2).run(bad_algorithm):
        assert message is not None and "algorithm" in message and "fused/tiles" in message, message


def test_a_variant_replaces_fused_only_when_its_own_median_is_lower_too():
    """The race's leader by the median relative to each round's fastest run, except that a fused variant must also
    have the lower median of its own runs (a variant that led its rounds while its own runs were slower than fused's
    then runs slower than fused; docs/journal/performance-journal.md)."""
    decide = observe.tuner_decide_from_samples
    # Two slow rounds where the variant is a little faster, then fast rounds where fused is as fast or faster.
    slow_spell = [[2.0, 2.0, 1.0, 1.0], [1.9, 1.9, 1.2, 0.99]]
    assert decide(["fused", "fused/tiles"], slow_spell, trust_medians=False) == "fused/tiles"  # the rule alone
    assert decide(["fused", "fused/tiles"], slow_spell) == "fused"
    assert decide(["fused", "fused/gathered-inputs"], slow_spell) == "fused"
    # A variant faster by both measures is taken; other algorithms keep the relative rule alone.
    assert decide(["fused", "fused/few-products"], [[1.0] * 4, [0.9] * 4]) == "fused/few-products"
    assert decide(["fused", "sequential"], slow_spell) == "sequential"
