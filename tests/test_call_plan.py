"""The CPU engine's data flow as a value (csrc/host/cpu/call_plan.h, through observe.plan_call): a table of calls and the
flow each takes, then random calls against an independent statement of the rules (docs/architecture.md). No ranks."""
import random

import pytest
import torch

from scoped_env import engine_switch
from torch_gemm_ar import _C
from engine_observation_build import observe

MiB = 1 << 20
F32, BF16, F64 = torch.empty(0), torch.empty(0, dtype=torch.bfloat16), torch.empty(0, dtype=torch.float64)


def plan(op, m, k, n, like=F32, world=2, **kw):
    return observe.plan_call(op, m, k, n, like, world, **kw)


def flow(*args, **kw):
    return plan(*args, **kw)["flow"]


def test_the_table(one_core_env):
    bf16_partial = 4 if _C._computes_in_fp32(BF16) else 2
    rows = [
        # op, m, k, n, like, world, keywords -> flow
        (("gemm_allreduce", 64, 64, 64), {}, "one-shot"),
        (("gemm_allreduce", 1024, 256, 1024), {}, "one-shot"),  # (world - 1) x 4 MiB: at the bound
        (("gemm_allreduce", 1024, 256, 1024, F32, 3), {}, "owner-last"),  # twice the bound
        (("gemm_allreduce", 2048, 256, 1024), {}, "owner-last"),
        (("gemm_allreduce", 64, 64, 64, F32, 1), {}, "owner-last"),  # one rank: nobody to read from
        (("gemm_allreduce", 64, 64, 64, F64), {}, "one-shot"),
        (("gemm_allreduce", 64, 64, 64, BF16), {}, "one-shot"),  # decode: bf16 partials too
        (("gemm_allreduce", 128, 64, 64, BF16), {}, "one-shot" if bf16_partial == 4 else "owner-last"),
        (("gemm_allreduce", 64, 64, 64), {"epilogue": True}, "one-shot"),
        (("gemm_allreduce", 2048, 64, 1024), {"epilogue": True, "in_place": True}, "owner-last"),
        (("gemm_reduce_scatter", 64, 64, 64), {}, "owner-last"),  # never one shot: each rank keeps its chunk only
        (("allgather_gemm", 64, 64, 64), {}, "gathered-shards"),
    ]
    for args, kw, want in rows:
        assert flow(*args, **kw) == want, (args, kw, plan(*args, **kw))
    # A comm thread per rank: the comm blocks reduce, whatever the size.
    one_core_env.setenv("TORCH_GEMM_AR_COMM_THREADS", "1")
    assert flow("gemm_allreduce", 64, 64, 64) == "comm-blocks"
    assert flow("allgather_gemm", 64, 64, 64) == "gathered-shards"


def test_decode_calls(one_core_env):
    # M <= 64 within the one-shot bound, any dtype: one tile of the whole output, one GEMM call, one shot, the partials
    # in the call's dtype (2-byte bf16 ones too).
    for m in (1, 4, 16, 64):
        for like in (F32, BF16):
            got = plan("gemm_allreduce", m, 4096, 1024, like)
            assert (got["flow"], got["decode"], got["one_product"]) == ("one-shot", True, True), (m, like.dtype, got)
            assert "decode" in got["described"]
            assert observe.call_geometry("gemm_allreduce", m, 4096, 1000, like, 2) == (m, 1000, m)
    assert plan("gemm_allreduce", 5, 64, 64, epilogue=True)["decode"]
    assert plan("gemm_allreduce", 5, 64, 64, epilogue=True, in_place=True)["decode"]
    assert plan("gemm_allreduce", 3, 64, 64, world=3)["decode"]
    # Not: more rows, one rank, past the one-shot bound, the sequence-parallel ops.
    assert not plan("gemm_allreduce", 65, 4096, 1024)["decode"]
    assert not plan("gemm_allreduce", 4, 64, 64, world=1)["decode"]
    assert not plan("gemm_allreduce", 64, 64, 16385, F32, 2)["decode"]  # 64 x 16385 x 4 bytes: over 4 MiB
    assert plan("gemm_allreduce", 64, 64, 16385, BF16, 2)["decode"]  # half of it in bf16
    assert not plan("gemm_allreduce", 64, 64, 16385, BF16, 3)["decode"]
    assert not plan("gemm_reduce_scatter", 64, 64, 64)["decode"]
    assert not plan("allgather_gemm", 64, 64, 64)["decode"]
    # The options that make it one shot, and its own.
    for option in ("decode", "one_shot", "owner_last", "overlap"):
        with engine_switch(option, False):
            assert not plan("gemm_allreduce", 1, 4096, 1024)["decode"], option
    with engine_switch("decode", False):
        assert observe.call_geometry("gemm_allreduce", 1, 4096, 1000, F32, 2) != (1, 1000, 1)
    # Comm threads, or a tile from the environment: their geometry, not the decode one.
    one_core_env.setenv("TORCH_GEMM_AR_CPU_TILE", "128,256,64")
    assert not plan("gemm_allreduce", 1, 4096, 1024)["decode"]
    one_core_env.delenv("TORCH_GEMM_AR_CPU_TILE")
    one_core_env.setenv("TORCH_GEMM_AR_COMM_THREADS", "1")
    assert plan("gemm_allreduce", 1, 4096, 1024)["flow"] == "comm-blocks"


@pytest.mark.parametrize("option,value,want", [("one_shot", False, "owner-last"), ("owner_last", False, "comm-blocks"),
                                               ("overlap", False, "comm-blocks")])
def test_options_change_the_flow(one_core_env, option, value, want):
    assert flow("gemm_allreduce", 64, 64, 64) == "one-shot"
    with engine_switch(option, value):
        assert flow("gemm_allreduce", 64, 64, 64) == want
    assert flow("gemm_allreduce", 64, 64, 64) == "one-shot"


def test_one_product(one_core_env):
    # fp32, K > 2M from M = 512: the few-product family, whose geometry multiplies a partial in one GEMM call.
    long_k = plan("gemm_allreduce", 512, 2048, 512)
    assert long_k["one_product"] and long_k["flow"] == "one-shot", long_k
    assert not plan("gemm_allreduce", 2048, 64, 1024)["one_product"]  # the default tiles
    with engine_switch("one_product", False):
        assert not plan("gemm_allreduce", 512, 2048, 512)["one_product"]
    with engine_switch("owner_last", False):  # the comm blocks' flow never multiplies in one product
        assert not plan("gemm_allreduce", 512, 2048, 512)["one_product"]
    assert not plan("gemm_reduce_scatter", 512, 2048, 512)["one_product"]  # several row chunks


def test_output_slots(one_core_env):
    with engine_switch(_C._set_shared_output_slots, 8):
        got = plan("gemm_allreduce", 1100, 64, 1000)  # 4.4 MB of fp32 partials: past the one-shot bound
        assert got["flow"] == "owner-last" and got["slot_output_bytes"] == 1100 * 1000 * 4, got
        assert "output slot of 4400000 bytes" in got["described"]
        assert plan("gemm_allreduce", 1100, 64, 1000, epilogue=True)["slot_output_bytes"] == 0
        assert plan("gemm_allreduce", 64, 64, 64)["slot_output_bytes"] == 0  # one shot keeps its rows in the bank
    assert plan("gemm_allreduce", 1100, 64, 1000)["slot_output_bytes"] == 0


def expected(op, m, k, n, like, world, epilogue, in_place, comm_inline, options, slots):
    """The rules, stated independently of the C++ (allgather_gemm aside, whose flow is fixed)."""
    if op == "allgather_gemm":
        return "gathered-shards", 0, False
    if not (comm_inline and options["overlap"] and options["owner_last"]):
        return "comm-blocks", 0, False
    allreduce = op == "gemm_allreduce"
    # Decode: gemm_allreduce (add+RMSNorm too) of at most 64 rows whose partials in the call's dtype fit one shot.
    decode = (allreduce and options["one_shot"] and world > 1 and 1 <= m <= 64
              and m * n * like.element_size() * (world - 1) <= 4 * MiB)
    partial = 4 if like.dtype == torch.float32 or _C._computes_in_fp32(like) else like.element_size()
    partial = 8 if like.dtype == torch.float64 else partial
    partial = like.element_size() if decode else partial
    one_shot = (allreduce and world > 1 and (partial >= 4 or decode) and m * n * partial * (world - 1) <= 4 * MiB
                and options["one_shot"])
    slot = (not one_shot and allreduce and world > 1 and not epilogue and not in_place
            and m * n * like.element_size() >= MiB and slots > 0)
    return ("one-shot" if one_shot else "owner-last"), (m * n * like.element_size() if slot else 0), decode


def test_random_calls_follow_the_rules(one_core_env):
    rng = random.Random(20261204)
    for _ in range(400):
        op = rng.choice(["gemm_allreduce", "gemm_allreduce", "gemm_reduce_scatter", "allgather_gemm"])
        world = rng.randint(1, 4)
        m = rng.choice([1, 5, 64, 300, 1024, 1500, 2500]) * (world if op != "gemm_allreduce" else 1)
        k, n = rng.choice([1, 7, 64, 256, 3000]), rng.choice([1, 9, 128, 1000, 2100])
        like = rng.choice([F32, BF16, F64])
        epilogue = op == "gemm_allreduce" and rng.random() < 0.3
        in_place = epilogue and rng.random() < 0.5
        comm_inline = rng.random() < 0.8
        options = {name: rng.random() < 0.8 for name in ("overlap", "owner_last", "one_shot")}
        slots = rng.choice([0, 0, 8])
        one_core_env.setenv("TORCH_GEMM_AR_COMM_THREADS", "0" if comm_inline else "1")
        with engine_switch(_C._set_shared_output_slots, slots), \
                engine_switch("overlap", options["overlap"]), engine_switch("owner_last", options["owner_last"]), \
                engine_switch("one_shot", options["one_shot"]):
            got = plan(op, m, k, n, like, world, epilogue=epilogue, in_place=in_place)
            # One product: where the geometry asks for it, for the flows where the owner reduces in the compute
            # block (allgather_gemm: where every shard is in) and a plain gemm_allreduce.
            geometry = observe.call_multiplies_in_one_product("add_rmsnorm" if epilogue else op, m, k, n, like, world)
        want = expected(op, m, k, n, like, world, epilogue, in_place, comm_inline, options, slots)
        assert (got["flow"], got["slot_output_bytes"], got["decode"]) == want, (op, m, k, n, like.dtype, world, epilogue, in_place,
                                                                 comm_inline, options, slots, got)
        if op == "allgather_gemm":
            assert got["one_product"] == geometry, (op, m, k, n, world, got)
        else:
            owner_reduces = got["flow"] in ("owner-last", "one-shot")
            assert got["one_product"] == (geometry and owner_reduces and op == "gemm_allreduce"), (
                op, m, k, n, like.dtype, world, epilogue, options, got)
