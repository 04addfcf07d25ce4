"""The CPU engine's options (torch_gemm_ar.engine_options) and the product's lack of test hooks
(docs/decisions/0015-test-hooks.md)."""
import pytest

import torch
from torch_gemm_ar import _C, engine_options
from engine_observation_build import observe

OPTIONS = {"overlap", "owner_last", "row_epilogue_geometry", "wide_row_panels", "packed_b", "fewer_b_reorders",
           "one_shot", "one_product", "tune_tile_family", "tune_gathered_inputs", "decode"}


def test_every_option_has_its_default():
    current = engine_options.current()
    assert set(current) == OPTIONS
    assert current["fewer_b_reorders"] == 1
    assert all(current[name] is True for name in OPTIONS - {"fewer_b_reorders"})


def test_override_sets_and_restores_even_when_the_block_raises():
    before = engine_options.current()
    with pytest.raises(KeyError):
        with engine_options.override(one_shot=False, fewer_b_reorders=2):
            assert engine_options.current()["one_shot"] is False
            assert engine_options.current()["fewer_b_reorders"] == 2
            raise KeyError("inside")
    assert engine_options.current() == before


def test_bad_names_and_values_raise_naming_them_and_change_nothing():
    before = engine_options.current()
    with pytest.raises(ValueError, match="unknown engine option 'overlapp'.*overlap, owner_last"):
        with engine_options.override(one_shot=False, overlapp=False):
            pass
    with pytest.raises(ValueError, match=r"'fewer_b_reorders' must be in \[0, 2\]; got 3"):
        _C._set_engine_option("fewer_b_reorders", 3)
    assert engine_options.current() == before


def test_the_product_has_no_test_hooks():
    assert _C._test_build is False
    for name in ("_set_test_hook", "_test_hooks", "_set_tuner_slow_candidate", "protocol"):
        assert not hasattr(_C, name), name
    # The only setters left: the options, the output slots (a knob's value) and the logger.
    setters = {name for name in dir(_C) if name.startswith("_set_")}
    assert setters == {"_set_engine_option", "_set_shared_output_slots", "_set_tuner_logger"}


def test_observations_are_not_product_bindings():
    # What only tests observe (geometry rules, call counters, the tuner's rule) is bound by tests/engine_observation.
    for name in ("_plan_call", "_one_shot_calls", "_wide_row_geometry", "_reduce_rows", "_tuner_clear_memory"):
        assert not hasattr(_C, name), name
    assert observe.plan_call("gemm_allreduce", 64, 256, 96, torch.empty(0), 2)["flow"]
