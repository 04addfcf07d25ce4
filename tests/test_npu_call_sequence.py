"""The NPU host's order of fused calls on a group and its handling of an earlier call's failure
(csrc/host/npu/fused_call_sequence.h, csrc/host/common/kernel_error_watch.cpp), run against an emulated stream
runtime with several ranks in one process (tests/npu_host/sequence_main.cpp): streams are worker threads, events and
cross-stream waits behave as on the device, the fake kernels read the device epoch counter and meet their peers of
the same epoch within a bound, as the real ones do.

What must hold (docs/ascend.md, "Ordering of fused calls" and "Errors"):
- fused calls of one group queued on different streams, from one host thread or two, never run on the device at
  once, and every call gets the same epoch on every rank;
- a failure recorded by one rank's kernel is raised once, on that rank, at a later call, and every call after it
  still runs on every rank with aligned epochs (the group stays usable).
Each has a negative control, a test build with the fix taken out (GEMM_AR_TEST_CONTROL_*), that must fail the same
checks with the failure named."""
import concurrent.futures
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTROLS = {"fixed": [], "no_group_order": ["-DGEMM_AR_TEST_CONTROL_NO_GROUP_ORDER"],
            "raise_before_launch": ["-DGEMM_AR_TEST_CONTROL_RAISE_BEFORE_LAUNCH"]}
FAILED_RANK, FAILED_CALL = 1, 2  # sequence_main.cpp: the failure scenario's injected kernel failure


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    if not shutil.which("g++"):
        pytest.skip("g++ is needed to build the emulated-runtime harness")
    out = tmp_path_factory.mktemp("call_sequence")

    def build(name):
        binary = str(out / name)
        subprocess.run(["g++", "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread", *CONTROLS[name],
                        "-I" + os.path.join(ROOT, "csrc", "include"), "-I" + os.path.join(ROOT, "csrc", "host"),
                        os.path.join(ROOT, "tests", "npu_host", "sequence_main.cpp"),
                        os.path.join(ROOT, "csrc", "host", "common", "kernel_error_watch.cpp"), "-o", binary],
                       check=True)
        return binary

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(zip(CONTROLS, pool.map(build, CONTROLS)))


def run(binary, scenario, world, calls, seed):
    proc = subprocess.run([binary, scenario, str(world), str(calls), str(seed)], capture_output=True, text=True,
                          timeout=300, check=True)
    result = {"calls": {}, "raised": []}
    for line in proc.stdout.splitlines():
        fields = line.split()
        if fields[0] == "call":
            rank, index, compute_epoch, comm_epoch = map(int, fields[1:5])
            result["calls"][(rank, index)] = (compute_epoch, comm_epoch, fields[5])
        elif fields[0] == "raised":
            result["raised"].append((int(fields[1]), int(fields[2]), line.split(" ", 3)[3]))
        else:
            result[fields[0]] = int(fields[1])
    return result


def problems(result, world, calls, failed=None, may_time_out=()):
    """Every way the run broke the rules; failed = (rank, call) of the one injected kernel failure; calls in
    may_time_out may end in a timeout on any rank."""
    found = []
    if result["overlaps"]:
        found.append(f"overlap: kernels of two calls of one group ran at once {result['overlaps']} times")
    if result["reused_epochs"]:
        found.append(f"reused epoch: a rank met its peers twice with one epoch ({result['reused_epochs']} times)")
    for index in range(calls):
        for rank in range(world):
            compute_epoch, comm_epoch, status = result["calls"][(rank, index)]
            want = "failed" if (rank, index) == failed else "ok"
            if status != want and not (index in may_time_out and status == "timeout"):
                found.append(f"status: rank {rank} call {index} {status}, expected {want}")
            # Epochs count from the agreed first one: call i runs with epoch i on every rank, in both kernels.
            if (compute_epoch, comm_epoch) != (index, index):
                found.append(f"epoch: rank {rank} call {index} ran with epochs {compute_epoch}/{comm_epoch}")
    return found


@pytest.mark.parametrize("scenario", ["side_stream", "two_threads"])
@pytest.mark.parametrize("world,seed", [(2, 1), (3, 2), (4, 3)])
def test_calls_of_one_group_on_several_streams_run_one_at_a_time(builds, scenario, world, seed):
    result = run(builds["fixed"], scenario, world, 24, seed)
    assert problems(result, world, 24) == []
    assert result["raised"] == []


@pytest.mark.parametrize("scenario", ["side_stream", "two_threads"])
def test_negative_control_without_the_group_order_calls_overlap(builds, scenario):
    result = run(builds["no_group_order"], scenario, 2, 24, 1)
    found = problems(result, 2, 24)
    assert any(p.startswith("overlap:") for p in found), found


@pytest.mark.parametrize("world,seed", [(2, 4), (3, 5), (4, 6)])
def test_a_failure_is_raised_once_and_the_group_keeps_working(builds, world, seed):
    calls = 8
    result = run(builds["fixed"], "failure", world, calls, seed)
    assert problems(result, world, calls, failed=(FAILED_RANK, FAILED_CALL)) == []
    # Raised on the rank that recorded it, once, at one of its next calls (when its copy of the record landed).
    assert len(result["raised"]) == 1, result["raised"]
    rank, index, message = result["raised"][0]
    assert rank == FAILED_RANK and index > FAILED_CALL, result["raised"]
    assert f"call #{FAILED_CALL + 1} on group 'tp' failed: rank {FAILED_RANK}" in message, message
    assert "The group stays usable" in message, message


def test_negative_control_raising_before_the_launch_desynchronises_the_group(builds):
    calls = 8
    result = run(builds["raise_before_launch"], "failure", 3, calls, 5)
    found = problems(result, 3, calls, failed=(FAILED_RANK, FAILED_CALL))
    # The raising rank skipped a call, so its later calls run one epoch behind its peers'.
    assert any(p.startswith(f"status: rank {FAILED_RANK}") and "not_run" in p for p in found), found
    assert any(p.startswith(f"epoch: rank {FAILED_RANK}") for p in found), found


STRAGGLER_LATE_CALL, STRAGGLER_MEET_AFTER = 2, 4  # sequence_main.cpp: rank 1 pauses before call 2; all meet after 4


@pytest.mark.parametrize("world,seed", [(2, 7), (3, 8)])
def test_a_straggler_s_timeouts_leave_the_group_usable(builds, world, seed):
    # Rank 1 comes later than the kernels' bound: its peers' calls time out (NaN, raised later), and once the ranks
    # have met again (an HCCL collective with a wait does that) every call works, with aligned epochs throughout.
    calls = 8
    result = run(builds["fixed"], "straggler", world, calls, seed)
    late = range(STRAGGLER_LATE_CALL, STRAGGLER_MEET_AFTER + 1)
    assert problems(result, world, calls, may_time_out=late) == []
    timed_out = {(r, i) for (r, i), (_, _, status) in result["calls"].items() if status == "timeout"}
    assert timed_out, "the straggler made no peer time out: the scenario tests nothing"
    raised_ranks = {rank for rank, _, _ in result["raised"]}
    assert {r for r, _ in timed_out} <= raised_ranks, (timed_out, result["raised"])


def test_negative_control_raising_before_the_launch_keeps_a_straggler_s_group_broken(builds):
    calls = 8
    result = run(builds["raise_before_launch"], "straggler", 3, calls, 8)
    late = range(STRAGGLER_LATE_CALL, STRAGGLER_MEET_AFTER + 1)
    found = problems(result, 3, calls, may_time_out=late)
    assert any("not_run" in p for p in found), found
