"""No host synchronisation per call (docs/decisions/0008-npu-call-sequence-without-host-sync.md): after the first call
of a group, a fused NPU call must not synchronise with the device, copy from it synchronously, allocate outside the
caching allocators, or agree over the process group. This checks the translation units of the per-call path, compiled
against the real torch-npu 2.13.0 headers (as tests/test_npu_host_compile.py does), three ways:

1. symbols: no reference to a synchronising or allocating API, and no such inline helper emitted (the units are
   built at -O0, so the inline helpers they use are emitted into them: what the compiler really calls);
2. source: no synchronising idiom in the code (comments stripped);
3. reach: every project function they call that is not itself in a per-call unit is on a short allow-list, each
   with the reason it is safe per call (e.g. comm_state: a cached lookup after the group's setup).

The device is reached through the runtime seam (csrc/host/npu/device_runtime.h). Its non-blocking half, the
DeviceQueue, is implemented over torch_npu in device_queue_npu.cpp, a per-call unit here, so every call behind it is
checked like the path's own (virtual calls leave no symbol in the caller, so the implementation itself must be
checked). Its blocking half, the DeviceControl, is implemented in another unit: reaching it from the per-call path is
a reach problem (device_control() is not allow-listed), and per-call source never names it.

The per-call path must not take a stream from torch_npu's pool either (it can hand out the caller's own stream).

The negative controls inject a `.cpu()`, an `aclrtSynchronizeStream`, a call to the syncing check_all_errors(), a
blocking `copy_(src)`, a `Work::wait()`, `.to(kCPU)`, a pool stream and a DeviceControl call into a copy of
fused_npu.cpp, and an event synchronisation into a copy of device_queue_npu.cpp, and require the checks to fail.
check_ranks_agree, the one allow-listed exchange, is checked structurally to run only before the group agreed or for
calls that do not run the kernels (with negative controls that move or loosen the guard)."""
import concurrent.futures
import os
import re

import pytest

from test_npu_host_compile import HEADERS_MISSING, ROOT, _demangle, _symbols

pytestmark = pytest.mark.skipif(
    HEADERS_MISSING, reason="torch-npu 2.13.0 headers not found: set TORCH_NPU_ROOT (see test_npu_host_compile.py)"
)

# What a fused call runs on the host, call after call (op flow -> NPU hooks -> fused path).
PER_CALL_SOURCES = [os.path.join(ROOT, "csrc", "host", p) for p in (
    "npu/fused_npu.cpp", "npu/npu_op.cpp", "common/op_flow.cpp", "common/call_args.cpp", "common/settings.cpp",
    "common/algorithm.cpp", "common/kernel_error_watch.cpp", "common/auto_tuner.cpp", "common/tuning_race.cpp",
    "common/tune_cache_file.cpp", "common/sequence_parallel_flow.cpp", "npu/add_rmsnorm_npu_op.cpp", "common/add_rmsnorm.cpp",
    "common/current_op.cpp", "npu/device_queue_npu.cpp",
)]

# Demangled undefined symbols that synchronise, copy synchronously, allocate outside the caching allocators or run a
# collective; and torch_npu's stream pool, whose stream can be the caller's own (the comm kernels have the group's
# own stream: docs/ascend.md, "Ordering of fused calls").
DENIED_SYMBOLS = [
    r"c10_npu::getNPUStreamFromPool", r"c10_npu::getStreamFromPool",
    r"^aclrtSynchronize", r"^aclrtMemcpy$", r"^aclrtMemcpy2d$", r"^aclrtMalloc", r"^aclrtFree",
    r"^HcclAllReduce", r"^HcclAllGather", r"^HcclBarrier",
    r"c10_npu::NPUEvent::synchronize", r"c10_npu::NPUStream::synchronize", r"c10_npu::npuSynchronize",
    r"c10_npu::device_synchronize", r"at::Tensor::cpu\(", r"at::TensorBase::cpu\(", r"at::_ops::item::call",
    r"at::_ops::_local_scalar_dense::call", r"c10d::ProcessGroup::allreduce", r"c10d::ProcessGroup::barrier",
]

# The same in source form (what a reviewer would grep for).
DENIED_SOURCE = [
    r"\.cpu\(", r"\.item\s*\(", r"\.item<\w+>\s*\(", r"synchroni[sz]e\s*\(", r"aclrtSynchronize", r"aclrtMemcpy\s*\(",
    r"aclrtMalloc", r"\ballreduce\s*\(", r"\bbarrier\s*\(", r"->wait\s*\(", r"non_blocking\s*=\s*\*/\s*false",
    r"\.to\(\s*(at::|c10::)?kCPU", r"\.tolist\(",
    # A blocking copy: copy_(src) with the default non_blocking=false (a D2H copy waits for the device).
    r"\.copy_\(\s*[^,()]*(\([^()]*\))?[^,()]*\)", r"non_blocking\s*=\s*false",
    r"\bWork::wait\b", r"\.wait\s*\(\s*\)",
    r"\.to\(\s*(at::|c10::)?Device\(\s*(at::|c10::)?(kCPU|DeviceType::CPU)", r"\.to\(\s*(at::|c10::)?DeviceType::CPU",
    r"\.to\(\s*\"cpu\"",
    # The blocking half of the device runtime seam.
    r"\bdevice_control\s*\(", r"\bDeviceControl\b",
]

# Project functions outside the per-call units that the per-call path may call, and why that is safe.
ALLOWED_PROJECT_CALLS = {
    "gemm_ar::npu::comm_state": "setup collective on a group's first call; afterwards a map lookup",
    "gemm_ar::check_ranks_agree": "the host exchange: only the first fused call of a group, and non-fused calls",
    "gemm_ar::npu::wait_and_raise_errors": "only with TORCH_GEMM_AR_NPU_SYNC_ERRORS=1 (opt-in sync)",
    "gemm_ar::run_sequential": "the sequential algorithm (HCCL collectives are its job), never a fused call",
    "gemm_ar::run_chunked": "the chunked algorithm, never a fused call",
    "gemm_ar::run_local": "one-rank groups: a plain local GEMM",
    "gemm_ar::carry_result_on_agreement": "sequential calls on CPU tensors only (returns at once otherwise)",
    "gemm_ar::call_signature": "pure: fills an array (rank_agreement.cpp)",
    "gemm_ar::agreement_problem_is_value_error": "pure: classifies error codes (rank_agreement.cpp)",
    "gemm_ar::signature_field_name": "pure: a table lookup (rank_agreement.cpp)",
    "gemm_ar::kTuneStepFieldName": "a string constant (rank_agreement.cpp)",
    "gemm_ar::agreement_problem_is_not_implemented": "pure: classifies error codes (rank_agreement.cpp)",
    # Quantized calls (quantization.cpp): the checks read the tensors' metadata only (dtype, shape, device).
    "gemm_ar::quantization_requested": "pure: reads dtypes and which arguments are given",
    "gemm_ar::check_quantization": "reads the scales' metadata (dtype, shape, device), never their data",
    "gemm_ar::is_quantized": "pure: reads a field",
    "gemm_ar::numeric_format": "pure: packs fields into one word",
    "gemm_ar::numeric_format_name[abi:cxx11]": "pure: formats a word (auto's tuning calls and error messages)",
    "gemm_ar::npu::start_npu_clock": "auto's tuning calls only (a bucket's first few calls): records a timing event",
    "gemm_ar::npu::npu_stream_capturing": "a capture-status query (no device wait)",
    "gemm_ar::monotonic_us": "auto's tuning calls: clock_gettime(CLOCK_MONOTONIC) on the host (host_clock.cpp)",
    "gemm_ar::monotonic_clock_domain": "auto's tuning calls: a hash of /proc entries, read once per process",
    # Called by DeviceQueue::launch (device_queue_npu.cpp).
    "gemm_ar::launch_gemm_compute": "the bisheng launch shim: queues the kernel on the stream",
    "gemm_ar::launch_gemm_comm": "the bisheng launch shim: queues the kernel on the stream",
    "gemm_ar::launch_rs_compute": "the bisheng launch shim: queues the kernel on the stream",
    "gemm_ar::launch_rs_comm": "the bisheng launch shim: queues the kernel on the stream",
    "gemm_ar::launch_ag_compute": "the bisheng launch shim: queues the kernel on the stream",
    "gemm_ar::launch_ag_comm": "the bisheng launch shim: queues the kernel on the stream",
    # The sequence-parallel ops' `sequential` algorithm (sequence_parallel_flow.cpp), never a fused call.
    "gemm_ar::reduce_scatter_along": "the sequential reduce-scatter (an HCCL collective is its job)",
    "gemm_ar::all_gather_along": "the sequential all-gather (an HCCL collective is its job)",
    "gemm_ar::LocalGemm::LocalGemm": "the sequential algorithm's local product",
    "gemm_ar::LocalGemm::compute": "the sequential algorithm's local product",
}




def _strip_comments(text):
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)) if "non_blocking" not in m.group(0)
                  else m.group(0), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _function_name(demangled):
    """'gemm_ar::npu::comm_state(c10d::ProcessGroup&, ...)' -> 'gemm_ar::npu::comm_state'."""
    depth, end = 0, len(demangled)
    for i, ch in enumerate(demangled):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            end = i
            break
    return demangled[:end]


def problems(objects, sources):
    """Every reason the given per-call objects/sources break the rule (empty: they keep it)."""
    found = []
    defined_here = set()
    undefined, defined = {}, {}
    for obj in objects:
        defined[obj] = list(_demangle(sorted(_symbols(obj, defined=True))).values())
        defined_here |= {_function_name(d) for d in defined[obj]}
        names = sorted(_symbols(obj, defined=False))
        undefined[obj] = list(_demangle(names).values()) if names else []
    for obj in objects:
        # Defined too: at -O0 the inline helpers a unit uses (Tensor::cpu(), item<T>()) are emitted into it.
        for name in undefined[obj] + defined[obj]:
            for pattern in DENIED_SYMBOLS:
                if re.search(pattern, name):
                    found.append(f"symbols: {os.path.basename(obj)} calls {name}")
    for obj, names in undefined.items():
        for name in names:
            function = _function_name(name)
            if function.startswith("gemm_ar::") and function not in defined_here:
                if function not in ALLOWED_PROJECT_CALLS:
                    found.append(f"reach: {os.path.basename(obj)} calls {function}, which is neither per-call code "
                                 f"nor on the allow-list")
    for source in sources:
        with open(source) as f:
            text = _strip_comments(f.read())
        for pattern in DENIED_SOURCE:
            for match in re.finditer(pattern, text):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"source: {os.path.basename(source)}:{line} has {match.group(0)!r}")
    return found


@pytest.fixture(scope="module")
def per_call_objects(npu_objects):
    results = npu_objects.get_all(PER_CALL_SOURCES)  # shared with test_npu_host_compile.py, compiled in parallel
    for source, result in zip(PER_CALL_SOURCES, results):
        assert result.returncode == 0, f"{source} does not compile:\n{result.stderr[-6000:]}"
    return [result.obj for result in results]


# Headers of the per-call path whose code is compiled into the units above (their symbols are checked there); their
# source is checked here too.
PER_CALL_HEADERS = [os.path.join(ROOT, "csrc", "host", "npu", "fused_call_sequence.h")]


def test_per_call_path_does_not_synchronise(per_call_objects):
    found = problems(per_call_objects, PER_CALL_SOURCES + PER_CALL_HEADERS)
    assert not found, "the per-call NPU path synchronises or reaches code that may:\n" + "\n".join(found)


def test_allow_list_is_not_stale(per_call_objects):
    # Every allowed entry is really called: a stale allow-list would hide what it once excused.
    called = set()
    for obj in per_call_objects:
        called |= {_function_name(d) for d in _demangle(sorted(_symbols(obj, defined=False))).values()}
    stale = sorted(set(ALLOWED_PROJECT_CALLS) - called)
    assert not stale, f"allow-listed but never called from the per-call path: {stale}"


# Injected right after the fused gemm_allreduce path allocates `out`; each must be caught by the checks named.
INJECTIONS = {
    "tensor_cpu": ("  (void)out.cpu();\n", {"symbols", "source"}),
    "acl_synchronize_stream": ("  (void)aclrtSynchronizeStream(nullptr);\n", {"symbols", "source"}),
    "syncing_project_call": ("  check_all_errors();\n", {"reach"}),
    "blocking_copy_to_host": ("  { at::Tensor host = at::empty({1}); host.copy_(out); }\n", {"source"}),
    "blocking_copy_to_host_nested": ("  at::empty({1}).copy_(out.view(-1));\n", {"source"}),
    "work_wait": ("  { c10::intrusive_ptr<c10d::Work> work; if (work) work->wait(); }\n", {"source"}),
    "to_cpu_device": ("  (void)out.to(at::Device(at::kCPU));\n", {"source"}),
    "to_kcpu": ("  (void)out.to(at::kCPU);\n", {"source"}),
    "pool_stream": ("  (void)c10_npu::getNPUStreamFromPool(call.b.device().index());\n", {"symbols"}),
    "device_control_call": ("  device_control().synchronize_device(call.b.device());\n", {"reach", "source"}),
}


_INJECTION_ANCHOR = "  auto out = device_queue().empty({call.m, call.n}, call.b.options());\n"


def _injected_source(names):
    """fused_npu.cpp with the injections `names` right after the anchor (and acl.h, which some of them call)."""
    with open(PER_CALL_SOURCES[0]) as f:
        text = f.read()
    assert text.count(_INJECTION_ANCHOR) == 1, "anchor for the injection not found in fused_npu.cpp"
    code = "".join(INJECTIONS[name][0] for name in names)
    return text.replace(_INJECTION_ANCHOR, _INJECTION_ANCHOR + code).replace(
        '#include "npu/sync_points.h"',
        '#include "npu/sync_points.h"\n#include <acl/acl.h>\n#include <torch_npu/csrc/core/npu/NPUStream.h>')


def _needs_object(name):
    return bool(INJECTIONS[name][1] - {"source"})


@pytest.fixture(scope="module")
def injected(tmp_path_factory, npu_objects):
    """name -> (broken source path, its object). The injections caught by symbols or reach are compiled one by one;
    the ones caught in the source text are compiled once together (which shows each is real C++ at that spot) and
    checked with the unbroken object. All compiles run in parallel."""
    out_dir = tmp_path_factory.mktemp("injected")
    sources, jobs = {}, {}
    source_only = sorted(name for name in INJECTIONS if not _needs_object(name))
    for name in INJECTIONS:
        sources[name] = str(out_dir / name / "fused_npu.cpp")
        os.makedirs(os.path.dirname(sources[name]))
        with open(sources[name], "w") as f:
            f.write(_injected_source([name]))
        if _needs_object(name):
            jobs[name] = sources[name]
    together = str(out_dir / "source_only_together" / "fused_npu.cpp")
    os.makedirs(os.path.dirname(together))
    with open(together, "w") as f:
        f.write(_injected_source(source_only))
    jobs["source_only_together"] = together
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = dict(zip(jobs, pool.map(lambda src: npu_objects.compile(src, src + ".o"), jobs.values())))
    for name, result in results.items():
        assert result.returncode == 0, f"{jobs[name]} does not compile:\n{result.stderr[-6000:]}"
    objects = {name: result.obj for name, result in results.items()}
    return {name: (sources[name], objects.get(name)) for name in INJECTIONS}


@pytest.mark.parametrize("name", sorted(INJECTIONS))
def test_negative_control_injected_sync_is_caught(per_call_objects, injected, name):
    code, expected_kinds = INJECTIONS[name]
    broken, obj = injected[name]
    found = problems([obj or per_call_objects[0]] + per_call_objects[1:], [broken])
    kinds = {line.split(":")[0] for line in found}
    assert expected_kinds <= kinds, f"injected {code.strip()!r} was not caught by {expected_kinds - kinds}: {found}"


# The queue's implementation is checked as the path's own code: an event wait behind DeviceQueue::query.
_QUEUE_SOURCE = os.path.join(ROOT, "csrc", "host", "npu", "device_queue_npu.cpp")
_QUEUE_ANCHOR = "  bool query(const DeviceEvent& event) override { return event->event.query(); }\n"
_QUEUE_BLOCKING = "  bool query(const DeviceEvent& event) override {\n    event->event.synchronize();\n    return true;\n  }\n"


def test_negative_control_blocking_call_behind_the_device_queue_is_caught(per_call_objects, npu_objects, tmp_path):
    with open(_QUEUE_SOURCE) as f:
        text = f.read()
    assert text.count(_QUEUE_ANCHOR) == 1, "anchor for the injection not found in device_queue_npu.cpp"
    broken = tmp_path / "device_queue_npu.cpp"
    broken.write_text(text.replace(_QUEUE_ANCHOR, _QUEUE_BLOCKING))
    result = npu_objects.compile(str(broken), str(tmp_path / "device_queue_npu.o"))
    assert result.returncode == 0, f"{broken} does not compile:\n{result.stderr[-6000:]}"
    index = PER_CALL_SOURCES.index(_QUEUE_SOURCE)
    objects = per_call_objects[:index] + [result.obj] + per_call_objects[index + 1:]
    found = problems(objects, [str(broken)])
    kinds = {line.split(":")[0] for line in found}
    assert {"symbols", "source"} <= kinds, found


# check_ranks_agree is allow-listed for "the first fused call of a group, and non-fused calls" only. That claim is
# checked on the code's structure: in fused_npu.cpp every call sits in a block entered only when the group has not
# agreed yet or the call does not run the kernels, `agreed` comes from nothing but the group's state, and the NPU
# hooks route the agreement through agree_fused (op_flow.cpp's direct call is for backends without a hook).
AGREE_GUARD = "if (!agreed || !runs_kernels)"


def _enclosing_block_header(text, pos):
    """The text between the statement before the innermost `{` enclosing pos and that `{` (e.g. 'if (x)')."""
    depth = 0
    for i in range(pos - 1, -1, -1):
        if text[i] == "}":
            depth += 1
        elif text[i] == "{":
            if depth == 0:
                start = max(text.rfind(";", 0, i), text.rfind("{", 0, i), text.rfind("}", 0, i)) + 1
                return " ".join(text[start:i].split())
            depth -= 1
    return ""


def agreement_guard_problems(fused_text, npu_op_text):
    found = []
    fused = _strip_comments(fused_text)
    calls = [m.start() for m in re.finditer(r"\bcheck_ranks_agree\s*\(", fused)]
    if not calls:
        found.append("fused_npu.cpp no longer calls check_ranks_agree: update this test and the allow-list")
    for pos in calls:
        header = _enclosing_block_header(fused, pos)
        if header != AGREE_GUARD:
            line = fused.count("\n", 0, pos) + 1
            found.append(f"fused_npu.cpp:{line} calls check_ranks_agree under {header!r}, not {AGREE_GUARD!r}")
    assignments = sorted(set(m.group(0) for m in re.finditer(r"\bagreed\s*=[^=;][^;]*;", fused)))
    if assignments != ["agreed = false;", "agreed = state.agreed;", "agreed = true;"]:
        found.append(f"`agreed` is set by {assignments}, not only from the group's state")
    if "state.agreed = true;" not in fused.split("check_ranks_agree", 1)[-1]:
        found.append("state.agreed is set before (not after) the exchange succeeded")
    if not re.search(r"hooks\.check_agreement\s*=\s*&agree_fused\s*;", _strip_comments(npu_op_text)):
        found.append("npu_op.cpp does not route the agreement through agree_fused")
    return found


def _read(name):
    with open(os.path.join(ROOT, "csrc", "host", "npu", name)) as f:
        return f.read()


def test_check_ranks_agree_runs_only_before_agreement_or_off_the_kernels():
    found = agreement_guard_problems(_read("fused_npu.cpp"), _read("npu_op.cpp"))
    assert not found, "\n".join(found)


# Broken on purpose: the exchange on every call, the guard loosened, the hook dropped.
GUARD_INJECTIONS = {
    "unguarded_exchange": lambda f, n: (f.replace("  if (chosen == Algorithm::Fused && call.error.empty() && call.m > 0)"
                                                  " return {};",
                                                  "  (void)check_ranks_agree(group, call, chosen, device);\n"
                                                  "  if (chosen == Algorithm::Fused && call.error.empty() && call.m > 0)"
                                                  " return {};", 1), n),
    "guard_loosened": lambda f, n: (f.replace(AGREE_GUARD, "if (!agreed || true)", 1), n),
    "hook_dropped": lambda f, n: (f, n.replace("hooks.check_agreement = &agree_fused;", "", 1)),
}


@pytest.mark.parametrize("name", sorted(GUARD_INJECTIONS))
def test_negative_control_unguarded_agreement_is_caught(name):
    fused, npu_op = _read("fused_npu.cpp"), _read("npu_op.cpp")
    broken_fused, broken_npu_op = GUARD_INJECTIONS[name](fused, npu_op)
    assert (broken_fused, broken_npu_op) != (fused, npu_op), f"injection {name!r} found no anchor"
    assert agreement_guard_problems(broken_fused, broken_npu_op), f"injection {name!r} went unnoticed"
