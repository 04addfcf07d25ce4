"""The rows of a benchmark table: each is one way of getting all_reduce_sum(a_r @ b) + bias (or a part of it), run
on the same rotated input sets. A row knows how to run one call, what its output must equal, which row is its
compute-then-communicate counterpart (for speedup and overlap efficiency), and why it is absent when it is."""
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .dist_env import DistEnv
from .inputs import InputSet

# Every row key, in table order. The library's algorithms keep their own names; the rest say what they time.
ROW_ORDER = (
    "compute_only",
    "compute_reused",
    "engine_gemm",
    "traffic_floor",
    "allreduce_only",
    "sequential",
    "sequential_portable",
    "chunked",
    "fused_sequential",
    "fused",
    "fused_private",
    "auto",
    "baseline",
    "baseline_fp32",
    "npu_mm_all_reduce_base",
)
LIBRARY_ALGORITHMS = ("sequential", "chunked", "fused", "auto")

# Row kinds: how the metrics treat the row.
COMPUTE, COMM, SEQUENTIAL, PIPELINED, BASELINE = "compute", "comm", "sequential", "pipelined", "baseline"

# The text an algorithm that this build or this call cannot run raises (the op's own wording).
NOT_AVAILABLE = "not available"


@dataclass
class Row:
    key: str
    label: str
    kind: str
    run: Callable[[int], torch.Tensor]  # the timed call on input set i
    reference: Optional[str]  # the References field the output must match (reduced, reduced_no_bias or local); None:
    # a row that does not compute the op (traffic_floor)
    element_bytes: int  # element size of what this row's all_reduce moves (bus bandwidth)
    sequential_ref: Optional[str] = None  # the row this one overlaps: speedup, time saved, overlap efficiency
    prepare: Optional[Callable[[int], None]] = None  # untimed set-up before each call on input set i
    note: str = ""
    absent_reason: Optional[str] = None


def library_reduce_bytes(dtype, device: torch.device) -> int:
    """Bytes per element the library's all_reduce moves: the input dtype, like the user's baseline."""
    return torch.empty(0, dtype=dtype).element_size()


def available_row_keys(device_type: str, dtype) -> List[str]:
    """The rows that make sense for this device and dtype, in table order."""
    keys = [k for k in ROW_ORDER if k != "npu_mm_all_reduce_base" or device_type == "npu"]
    if device_type != "cpu":
        keys.remove("sequential_portable")
        keys.remove("engine_gemm")
    if device_type != "cpu" or not output_slots_on():
        keys.remove("fused_private")  # the same row as fused where outputs are never in window slots
    if device_type != "cpu" or (dtype in (torch.bfloat16, torch.float16) and library_computes_in_fp32(dtype)):
        keys.remove("compute_reused")  # there torch's GEMM of the dtype is not the library's (it converts to fp32)
        keys.remove("traffic_floor")
    if not (device_type == "cpu" and dtype in (torch.bfloat16, torch.float16) and library_computes_in_fp32(dtype)):
        keys.remove("baseline_fp32")
    return keys


def output_slots_on() -> bool:
    """Whether the CPU engine puts outputs in window slots (TORCH_GEMM_AR_SHARED_OUTPUTS)."""
    from torch_gemm_ar import _C
    return bool(getattr(_C, "_shared_output_slots", lambda: 0)())


def library_computes_in_fp32(dtype) -> bool:
    """Whether the library computes this CPU dtype in fp32 (bf16/fp16 on CPUs without their matrix instructions):
    only then is the fp32-compute baseline the fair comparison."""
    from torch_gemm_ar import _C
    return bool(_C._computes_in_fp32(torch.empty(0, dtype=dtype)))


def build_rows(env: DistEnv, sets: List[InputSet], dtype, keys: List[str]) -> Dict[str, Row]:
    lib = env.library
    group = env.group
    dtype_name = str(dtype).replace("torch.", "")
    reduce_bytes = library_reduce_bytes(dtype, env.device)
    rows: Dict[str, Row] = {}

    def library_call(algorithm: str, target_group=None):
        def run(i: int) -> torch.Tensor:
            s = sets[i]
            return lib.gemm_allreduce(s.a, s.b, target_group or group, bias=s.bias, algorithm=algorithm)
        return run

    if "compute_only" in keys:
        # A one-rank group takes the library's no-communication path: the very GEMM the algorithms run.
        rows["compute_only"] = Row("compute_only", "compute only", COMPUTE,
                                   library_call("auto", env.self_group), "local", reduce_bytes)

    if "compute_reused" in keys:
        # The same GEMM into one output kept across calls, as the engine's pooled outputs are. compute only gets a
        # fresh [M, N] tensor per call, as a user's matmul does, and pays its page faults, which at large outputs
        # are a sizeable share of the GEMM's time; fused does not. This row is the GEMM without them.
        reused: Dict[str, torch.Tensor] = {}

        def compute_reused(i: int) -> torch.Tensor:
            s = sets[i]
            a2d = s.a.reshape(-1, s.a.shape[-1])
            out = reused.get("out")
            if out is None:
                out = reused["out"] = torch.empty(a2d.shape[0], s.b.shape[1], dtype=dtype, device=s.a.device)
            if s.bias is not None:
                return torch.addmm(s.bias, a2d, s.b, out=out)
            return torch.mm(a2d, s.b, out=out)

        rows["compute_reused"] = Row("compute_reused", "compute only (reused out)", COMPUTE, compute_reused,
                                     "local", reduce_bytes)

    if "traffic_floor" in keys:
        rows["traffic_floor"] = traffic_floor_row(env, sets, dtype, reduce_bytes)

    if "engine_gemm" in keys:
        walk = getattr(getattr(lib, "_C", None), "_engine_tile_walk", None)

        def engine_gemm(i: int) -> torch.Tensor:
            if walk is None:
                raise RuntimeError("the engine's tile walk is not available in this build of the library")
            s = sets[i]
            return walk(s.a.reshape(-1, s.a.shape[-1]), s.b, s.bias, env.world)

        # The fused engine's GEMM alone: its tiles and packed B panels for this call, no communication.
        rows["engine_gemm"] = Row("engine_gemm", "engine GEMM only", COMPUTE, engine_gemm, "local", reduce_bytes)

    if "allreduce_only" in keys:
        # The buffer the library reduces (in the input dtype), refilled untimed because all_reduce is in place.
        compute_dtype = dtype
        partials = [torch.matmul(s.a.float(), s.b.float()).to(dtype) for s in sets]  # fp32: fast on every CPU
        scratch = torch.empty_like(partials[0])

        def refill(i: int):
            scratch.copy_(partials[i])

        def allreduce_only(i: int) -> torch.Tensor:
            dist.all_reduce(scratch, group=group)
            return scratch

        rows["allreduce_only"] = Row("allreduce_only",
                                     f"all_reduce only ({str(compute_dtype).replace('torch.', '')})",
                                     COMM, allreduce_only, "reduced_no_bias", reduce_bytes, prepare=refill)

    if "sequential" in keys:
        rows["sequential"] = Row("sequential", "sequential", SEQUENTIAL,
                                 library_call("sequential"), "reduced", reduce_bytes)
    if "sequential_portable" in keys:
        # The same algorithm on a group of the same ranks without the shared-memory engine, as for ranks on several
        # hosts: the agreement goes over the group, and small outputs ride on it (one collective per call).
        previous = os.environ.get("TORCH_GEMM_AR_CPU_ENGINE")
        os.environ["TORCH_GEMM_AR_CPU_ENGINE"] = "0"
        try:
            portable = dist.new_group(list(range(env.world)))
            lib.gemm_allreduce(sets[0].a, sets[0].b, portable, algorithm="sequential")  # sets the group up
        finally:
            if previous is None:
                del os.environ["TORCH_GEMM_AR_CPU_ENGINE"]
            else:
                os.environ["TORCH_GEMM_AR_CPU_ENGINE"] = previous
        rows["sequential_portable"] = Row("sequential_portable", "sequential (agreement over the group)",
                                          SEQUENTIAL, library_call("sequential", portable), "reduced", reduce_bytes)
    if "chunked" in keys:
        rows["chunked"] = Row("chunked", "chunked", PIPELINED, library_call("chunked"),
                              "reduced", reduce_bytes, sequential_ref="sequential")

    if "fused_sequential" in keys:
        options = getattr(lib, "engine_options", None)
        if options is not None:
            fused = library_call("fused")

            def fused_without_overlap(i: int) -> torch.Tensor:
                with options.override(overlap=False):
                    return fused(i)

            rows["fused_sequential"] = Row("fused_sequential", "sequential (same engine)",
                                           SEQUENTIAL, fused_without_overlap, "reduced", reduce_bytes)
        else:
            rows["fused_sequential"] = Row(
                "fused_sequential", "sequential (same engine)*", SEQUENTIAL, library_call("sequential"), "reduced",
                reduce_bytes,
                note="* torch_gemm_ar.engine_options is not in this build: this row is algorithm='sequential'")

    if "fused" in keys:
        rows["fused"] = Row("fused", "fused", PIPELINED, library_call("fused"), "reduced",
                            reduce_bytes, sequential_ref="fused_sequential")
    if "fused_private" in keys:  # only where outputs may be in window slots (available_row_keys)
        fused_in_slots = library_call("fused")

        def fused_private_outputs(i: int) -> torch.Tensor:
            previous = lib._C._set_shared_output_slots(0)  # every rank runs this row at the same call: they agree
            try:
                return fused_in_slots(i)
            finally:
                lib._C._set_shared_output_slots(previous)

        rows["fused_private"] = Row("fused_private", "fused (private outputs)", PIPELINED, fused_private_outputs,
                                    "reduced", reduce_bytes, sequential_ref="fused_sequential")
    if "auto" in keys:
        rows["auto"] = Row("auto", "auto", PIPELINED, library_call("auto"), "reduced",
                           reduce_bytes)

    def baseline_call(compute_dtype):
        def run(i: int) -> torch.Tensor:
            s = sets[i]
            a, b = s.a.to(compute_dtype), s.b.to(compute_dtype)  # no-ops when the dtype already matches
            out = torch.matmul(a, b)
            dist.all_reduce(out, group=group)
            if s.bias is not None:
                out += s.bias.to(compute_dtype)  # after the reduction: added once, as the op does
            return out.to(dtype)
        return run

    element = torch.empty(0, dtype=dtype).element_size()
    if "baseline" in keys:
        rows["baseline"] = Row("baseline", f"baseline ({dtype_name})", BASELINE,
                               baseline_call(dtype), "reduced", element)
    if "baseline_fp32" in keys:
        rows["baseline_fp32"] = Row("baseline_fp32", "baseline (fp32 compute)",
                                    BASELINE, baseline_call(torch.float32), "reduced", 4)

    if "npu_mm_all_reduce_base" in keys:
        import torch_npu

        def mm_all_reduce_base(i: int) -> torch.Tensor:
            s = sets[i]
            # The fused op adds its bias on every rank before reducing: give it on one rank only.
            bias = s.bias if env.rank == 0 else None
            return torch_npu.npu_mm_all_reduce_base(s.a, s.b, env.hcom_name, reduce_op="sum", bias=bias)

        rows["npu_mm_all_reduce_base"] = Row("npu_mm_all_reduce_base", "npu_mm_all_reduce_base", PIPELINED,
                                             mm_all_reduce_base, "reduced", element, sequential_ref="baseline")
    return {k: rows[k] for k in ROW_ORDER if k in rows}


def traffic_floor_row(env: DistEnv, sets: List[InputSet], dtype, reduce_bytes: int) -> Row:
    """About the least a fused data flow costs on ranks of one core each, measured on this CPU with torch's GEMM.
    Every rank must end with the whole reduced output, so it computes M x N x K multiply-adds (its own whole GEMM, or
    its share of the output rows by every rank's K at once: the same count) and writes every row of its output, the
    other ranks' rows included (copied, or stored there by their owners: measured at about the same cost). The row
    runs the faster of those two GEMMs (timed before the table, the same choice on every rank) and copies the other
    ranks' rows from a local buffer, without any communication, synchronisation, reduction or exchange of inputs.
    It does not compute the op, so nothing checks its values. Collective: every rank builds it at the same point.
    The closures hold tensors only (a reference to `env` would keep the process groups alive past their
    destruction, until the interpreter's exit tears them down under gloo's threads)."""
    world = env.world
    a0 = sets[0].a.reshape(-1, sets[0].a.shape[-1])
    m, n, device = a0.shape[0], sets[0].b.shape[1], a0.device
    share = (m + world - 1) // world  # the first ranks' shares of the rows, as the engine splits them
    row0 = min(env.rank * share, m)
    rows = max(min(share, m - row0), 0)
    out = torch.empty(m, n, dtype=dtype, device=device)
    partial = torch.empty(m, n, dtype=dtype, device=device)
    others = torch.ones(m - rows, n, dtype=dtype, device=device)  # the other ranks' rows (its pages touched)
    operands = []
    for s in sets:
        a2d = s.a.reshape(-1, s.a.shape[-1])
        operands.append((a2d, s.b, torch.cat([a2d[row0:row0 + rows]] * world, dim=1), torch.cat([s.b] * world)))
    gemms = {"own rows": lambda ops: torch.mm(ops[2], ops[3], out=out[row0:row0 + rows]),
             "local": lambda ops: torch.mm(ops[0], ops[1], out=partial)}
    form = _agreed_faster_gemm(gemms, operands, env.group)
    gemm = gemms[form]

    def traffic_floor(i: int) -> torch.Tensor:
        gemm(operands[i])
        out[:row0].copy_(others[:row0])
        out[row0 + rows:].copy_(others[row0:])
        return out

    note = "its GEMM here: " + ("every rank's rows by every rank's K" if form == "own rows"
                                else "every rank's whole local GEMM (M rows, its K)")
    return Row("traffic_floor", "floor: GEMM + copy of others' rows", COMPUTE, traffic_floor, None, reduce_bytes,
               note=note)


def _agreed_faster_gemm(gemms: Dict[str, Callable], operands: List[tuple], group, reps: int = 5) -> str:
    """The name of the faster GEMM in `gemms` (each called with one input set's operands): after a warm-up call of
    each, the median of `reps` interleaved runs on every rank, the slowest rank's median deciding (all_reduce MAX),
    so that every rank takes the same one."""
    import time

    for gemm in gemms.values():
        gemm(operands[0])
    dist.barrier(group=group)
    times: Dict[str, List[float]] = {name: [] for name in gemms}
    for r in range(reps):
        for name, gemm in gemms.items():
            start = time.perf_counter()
            gemm(operands[r % len(operands)])
            times[name].append(time.perf_counter() - start)
    medians = torch.tensor([sorted(t)[reps // 2] for t in times.values()], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)
    return list(gemms)[int(torch.argmin(medians))]


def is_not_available(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and NOT_AVAILABLE in str(exc)
