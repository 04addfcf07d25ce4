"""gemm_allreduce outputs in window slots (csrc/host/cpu/shared_outputs.h, opt-in: TORCH_GEMM_AR_SHARED_OUTPUTS):
on one-core ranks an owner writes its reduced rows once, into its output in its window, and peers copy them from
there (no bank). The tests check that the path is taken, results against float64 (each rank its own a, b and bias, odd shapes, 2 and 3 ranks, both flows),
that outputs a caller keeps stay intact (more than the slots, across a window growth, after the group is gone), that
a caller may overwrite its output at once, with a negative control (an owner that returns before its peers have
copied its rows is caught), and that ranks which differ in the switch get an error, not a hang."""
import gc
import random

import pytest
import torch
import torch.distributed as dist

import torch_gemm_ar
from inputs import TOLERANCE
from hooked_build import hooked
from scoped_env import engine_switch
from test_gathered_inputs import per_rank_inputs
from torch_gemm_ar import _C
from engine_observation_build import observe

ONE_CORE = dict(TORCH_GEMM_AR_COMPUTE_THREADS="1", TORCH_GEMM_AR_COMM_THREADS="0")
# Outputs of 1 MiB or more take a slot (kMinSlotOutputBytes), except calls whose fp32 partials a peer reads in one
# shot (4 MiB or less): bf16's partials are fp32 on CPUs without bf16 matrix instructions, so its shape is past that
# bound too, whichever CPU runs it.
SLOT_SHAPES = {torch.float32: (1500, 200, 1100), torch.bfloat16: (1100, 300, 1000)}
SLOTS = 3


def output_slots(slots=SLOTS):
    """One-core engine settings with `slots` output slots per window (set alike on every rank: it is agreed)."""
    return engine_switch(_C._set_shared_output_slots, slots, **ONE_CORE)


def reference(a, b, c, bias):
    return sum(x.double() @ y.double() for x, y in zip(a, b)) + (c[0].double() if bias else 0)


def close(out, ref, dtype, k, world):
    tol = TOLERANCE[dtype]
    return torch.allclose(out.double(), ref, rtol=tol, atol=tol * ((k * world) ** 0.5 + 1))


def right_results(rank, world, seed, dtype, bias, calls, slots=SLOTS):
    """`calls` fused calls of odd shapes with fresh inputs; returns (calls whose result was wrong, calls that took a
    slot)."""
    m0, k, n = SLOT_SHAPES[dtype]
    with output_slots(slots):
        before = observe.shared_output_calls()
        wrong = 0
        for i in range(calls):
            m = m0 + 37 * i
            a, b, c = per_rank_inputs(seed + i, world, m, k, n, dtype, bias)
            out = torch_gemm_ar.gemm_allreduce(a[rank], b[rank], bias=c[rank], algorithm="fused")
            wrong += not close(out, reference(a, b, c, bias), dtype, k, world)
        return wrong, observe.shared_output_calls() - before


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_slot_outputs_are_right(ranks, world, dtype, bias):
    for wrong, in_slots in ranks(world).run(right_results, random.randrange(1 << 20), dtype, bias, 4):
        assert wrong == 0
        assert in_slots == 4  # every call's output was in a slot: the path under test ran


def kept_outputs(rank, world, seed, keep):
    """Keeps `keep` outputs alive (more than the slots: the rest fall back to private outputs), then a larger call
    grows the windows while they live; every kept output is checked after all the calls, and once more after the
    process group is gone."""
    m, k, n = SLOT_SHAPES[torch.float32]
    with output_slots():
        before = observe.shared_output_calls()
        kept = []
        shapes = [(m + i, k, n) for i in range(keep)] + [(2 * m, k, 2 * n)]  # the last one needs larger windows
        for i, (mi, ki, ni) in enumerate(shapes):
            a, b, c = per_rank_inputs(seed + i, world, mi, ki, ni, torch.float32, False)
            kept.append((torch_gemm_ar.gemm_allreduce(a[rank], b[rank], algorithm="fused"), reference(a, b, c, False)))
        in_slots = observe.shared_output_calls() - before
        wrong = sum(not close(out, ref, torch.float32, k, world) for out, ref in kept)
        group = dist.new_group(list(range(world)))
        a, b, c = per_rank_inputs(seed, world, m, k, n, torch.float32, False)
        out = torch_gemm_ar.gemm_allreduce(a[rank], b[rank], algorithm="fused", group=group)
        wrong += not close(out, reference(a, b, c, False), torch.float32, k, world)
        dist.destroy_process_group(group)
        del group
        gc.collect()
        wrong += not close(out, reference(a, b, c, False), torch.float32, k, world)  # its engine is gone
        return wrong, in_slots, len(shapes)


def test_kept_outputs_stay_intact(ranks):
    for wrong, in_slots, calls in ranks(2).run(kept_outputs, random.randrange(1 << 20), SLOTS + 3):
        assert wrong == 0
        # The first SLOTS calls took a slot, the next ones fell back (every slot held); the larger call took a slot
        # of the grown windows.
        assert in_slots == SLOTS + 1, (in_slots, calls)


def overwritten_at_once(rank, world, seed, calls, no_wait):
    """Rank 0 reaches each call late (so its rows are final after rank 1's) and overwrites its output with NaN as
    soon as the call returns; rank 1 sleeps before each copy of a peer's rows (so it is still copying rank 0's rows
    when rank 0 could return) and checks its results. Returns (calls whose result was wrong, calls with a slot)."""
    import time

    m, k, n = 1100, 64, 1024  # 4.3 MiB outputs: the slot path (not one-shot); each owner has several stripes
    wrong = in_slots = 0
    with hooked("shared_output_no_wait", no_wait), hooked("peer_copy_delay_us", 2000 if rank == 1 else 0):
        with output_slots():
            for i in range(calls):
                a, b, c = per_rank_inputs(seed + i, world, m, k, n, torch.float32, False)
                dist.barrier()  # rank 1's sleeps of the call before must not make it the late one
                if rank == 0:
                    time.sleep(0.005)
                before = observe.shared_output_calls()
                out = torch_gemm_ar.gemm_allreduce(a[rank], b[rank], algorithm="fused")
                in_slots += observe.shared_output_calls() - before
                if rank == 0:
                    out.fill_(float("nan"))
                else:
                    wrong += not close(out, reference(a, b, c, False), torch.float32, k, world)
    return wrong, in_slots


def test_a_caller_may_overwrite_its_output_at_once(hooked_ranks):
    assert hooked_ranks(2).run(overwritten_at_once, random.randrange(1 << 20), 20, False, timeout_s=300) == [(0, 20)] * 2


def test_negative_control_an_owner_that_returns_before_its_peers_copied_is_caught(hooked_ranks):
    """The test above can fail: without the owner's wait for its peers' copies, some peer copies rows that their
    owner's caller has already overwritten."""
    results = hooked_ranks(2).run(overwritten_at_once, random.randrange(1 << 20), 20, True, timeout_s=300)
    assert results[0][1] == 20 and results[1][0] > 0, results


def slots_differ(rank, world):
    try:
        right_results(rank, world, 11, torch.float32, False, 1, slots=SLOTS if rank == 0 else SLOTS + 1)
        return None
    except ValueError as e:
        return str(e)


def test_ranks_that_differ_in_the_slots_get_an_error_not_a_hang(ranks):
    for message in ranks(2).run(slots_differ, timeout_s=120):
        assert message is not None and "engine's options" in message, message


def private_by_default(rank, world, seed):
    return right_results(rank, world, seed, torch.bfloat16, True, 2, slots=0)


def test_outputs_are_private_without_slots(ranks):
    for wrong, in_slots in ranks(2).run(private_by_default, random.randrange(1 << 20)):
        assert wrong == 0 and in_slots == 0


def test_bad_slot_counts_are_refused():
    with pytest.raises(ValueError, match="slots"):
        _C._set_shared_output_slots(16)
    with pytest.raises(ValueError, match="slots"):
        _C._set_shared_output_slots(-1)
