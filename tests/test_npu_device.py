"""pto::gemm_allreduce on real Ascend NPUs: every algorithm over HCCL against a float64 reference, with real rank
processes (one per device). Marked `npu`; skipped, with the reason, where torch_npu or the devices are missing.

Build first (docs/ascend.md), then: pytest -m npu tests/test_npu_device.py
"""
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.npu

# torch autoloads torch_npu when it is installed; without it there is no torch.npu.
HAVE_TORCH_NPU = hasattr(torch, "npu")
DEVICES = torch.npu.device_count() if HAVE_TORCH_NPU else 0

ALGORITHMS = ("sequential", "chunked", "fused", "auto")
# Not multiples of the NPU tiles (128 x 256, K step 256), plus a single row and a single-tile case.
SHAPES = ((300, 700, 520), (129, 256, 257), (1, 64, 1000), (128, 256, 256))


def _needs_devices(world):
    if not HAVE_TORCH_NPU:
        pytest.skip("torch_npu is not installed: these tests need Ascend NPUs with CANN and torch_npu")
    if DEVICES < world:
        pytest.skip(f"needs {world} NPUs, found {DEVICES}")


def _inputs(rank, world, m, k, n, dtype, case, transposed_b, with_bias):
    """This rank's a, the shared b and bias, and what the result is checked against: the float64 reference and the
    bound of its rounding error (_expected). All from seeds every rank knows."""
    def gen(seed):
        return torch.Generator().manual_seed(seed)

    a_all = [torch.randn(m, k, generator=gen(1000 * case + r)).to(dtype) for r in range(world)]
    if transposed_b:
        b = torch.randn(n, k, generator=gen(1000 * case + 999)).to(dtype).t()  # nn.Linear weight.t()
    else:
        b = torch.randn(k, n, generator=gen(1000 * case + 999)).to(dtype)
    # Large enough that a bias added twice or never is far outside the tolerance, even in bfloat16.
    bias = (16 * torch.randn(n, generator=gen(1000 * case + 998))).to(dtype) if with_bias else None
    return a_all[rank], b, bias, _expected(a_all, b, bias, dtype)


def _expected(a_all, b, bias, dtype):
    """(reference, element-wise error bound). Each rank's partial (fp32 accumulation, bias included on one rank) is
    rounded once to `dtype` and every step of the reduction rounds once more: at most (world + 1) roundings of
    eps/2 relative to the sum of |partial|, i.e. (world + 1) * eps * magnitude / 2; the bound allows twice that, plus
    the fp32 accumulation error."""
    partials = [a.double() @ b.double() for a in a_all]
    ref = sum(partials)
    magnitude = sum(p.abs() for p in partials)
    if bias is not None:
        ref = ref + bias.double()
        magnitude = magnitude + bias.double().abs()
    accumulation = 2.0**-22 * sum(a.double().abs() @ b.double().abs() for a in a_all)
    eps = torch.finfo(dtype).eps
    return ref, (len(a_all) + 1) * eps * magnitude + accumulation + 1e-6


def _check_close(out, expected, world, what):
    ref, bound = expected
    error = (out.double().cpu() - ref).abs()
    worst = (error / bound).max().item()
    assert worst <= 1.0, f"{what}: error reaches {worst:.3g}x the bound (max error {error.max().item():.4g})"


def _check_identical_on_all_ranks(out, group, what):
    gathered = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, out.contiguous(), group=group)
    for r, other in enumerate(gathered):
        assert torch.equal(other, out), f"{what}: rank {r}'s result differs from this rank's"


def _worker(rank, world, store_path, check):
    os.environ["HCCL_BUFFSIZE"] = "200"  # HCCL's default window, stated so that the window test knows it
    torch.npu.set_device(rank)
    dist.init_process_group("hccl", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        import torch_gemm_ar
        import torch_gemm_ar._C_npu  # noqa: F401  (the PrivateUse1 kernel)

        globals()[check](torch_gemm_ar, rank, world)
        torch.npu.synchronize()
    finally:
        dist.destroy_process_group()


def _every_algorithm(gar, rank, world):
    group = dist.group.WORLD
    case = 0
    for dtype in (torch.float16, torch.bfloat16):
        for m, k, n in SHAPES:
            for transposed_b in (False, True):
                for with_bias in (False, True):
                    case += 1
                    a, b, bias, expected = _inputs(rank, world, m, k, n, dtype, case, transposed_b, with_bias)
                    a, b = a.npu(), b.npu()
                    bias = bias.npu() if bias is not None else None
                    for algorithm in ALGORITHMS:
                        what = f"{algorithm} {dtype} M={m} K={k} N={n} bT={transposed_b} bias={with_bias}"
                        out = gar.gemm_allreduce(a, b, group, bias=bias, algorithm=algorithm)
                        assert out.shape == (m, n) and out.dtype == dtype and out.device == a.device, what
                        _check_close(out, expected, world, what)
                        _check_identical_on_all_ranks(out, group, what)


def _back_to_back_fused(gar, rank, world):
    """Many fused calls queued without a host sync in between, shapes changing from call to call."""
    group = dist.group.WORLD
    pending = []
    for call in range(24):
        m, k, n = SHAPES[call % len(SHAPES)]
        m += call  # a fresh shape every call
        a, b, bias, expected = _inputs(rank, world, m, k, n, torch.float16, 500 + call, call % 2 == 1, call % 3 == 0)
        bias = bias.npu() if bias is not None else None
        out = gar.gemm_allreduce(a.npu(), b.npu(), group, bias=bias, algorithm="fused")
        pending.append((out, expected, call))
    for out, expected, call in pending:
        _check_close(out, expected, world, f"back-to-back fused call {call}")


def _three_d_input(gar, rank, world):
    a, b, bias, expected = _inputs(rank, world, 2 * 75, 384, 300, torch.bfloat16, 900, True, True)
    out = gar.gemm_allreduce(a.view(2, 75, 384).npu(), b.npu(), bias=bias.npu(), algorithm="fused")
    assert out.shape == (2, 75, 300)
    _check_close(out.view(150, 300), expected, world, "3-D a")


def _add_rmsnorm_every_algorithm(gar, rank, world):
    """gemm_allreduce_add_rmsnorm (the epilogue in the comm kernel for `fused`, ATen after the others): out against
    float64, normed against float64 from the returned out (fp32 statistics), both identical on every rank."""
    group = dist.group.WORLD
    eps = 1e-5
    for case, (dtype, (m, k, n)) in enumerate([(d, s) for d in (torch.float16, torch.bfloat16) for s in SHAPES]):
        a, b, bias, (ref, bound) = _inputs(rank, world, m, k, n, dtype, 700 + case, case % 2 == 1, True)
        gen = torch.Generator().manual_seed(7000 + case)  # the same residual stream and weight on every rank
        residual = torch.randn(m, n, generator=gen).to(dtype)
        weight = (0.5 + torch.rand(n, generator=gen)).to(dtype)
        expected = (ref + residual.double(), bound + torch.finfo(dtype).eps * (ref + residual.double()).abs())
        for algorithm in ALGORITHMS:
            what = f"add_rmsnorm {algorithm} {dtype} M={m} K={k} N={n}"
            out, normed = gar.gemm_allreduce_add_rmsnorm(a.npu(), b.npu(), residual.npu(), weight.npu(), group,
                                                         eps=eps, bias=bias.npu(), algorithm=algorithm)
            _check_close(out, expected, world, what + " out")
            x = out.double().cpu()
            want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
            error = (normed.double().cpu() - want).abs()
            assert (error <= torch.finfo(dtype).eps * want.abs() + 1e-4).all(), f"{what}: normed off by {error.max()}"
            _check_identical_on_all_ranks(out, group, what + " out")
            _check_identical_on_all_ranks(normed, group, what + " normed")


def _window_too_small(gar, rank, world):
    """12288 x 12288 fp16 needs about 290 MiB of window; HCCL_BUFFSIZE=200 gives 200 MiB: `fused` raises naming
    HCCL_BUFFSIZE, `auto` warns and runs `chunked`. Checked on a few rows (a float64 reference of all is too big)."""
    m = n = 12288
    k = 64
    a_all = [torch.randn(m, k, generator=torch.Generator().manual_seed(950 + r)).half() for r in range(world)]
    b = torch.randn(k, n, generator=torch.Generator().manual_seed(999)).half()
    rows = torch.tensor([0, 1, 2, 4095, 8191, m - 2, m - 1])
    expected = _expected([a[rows] for a in a_all], b, None, torch.float16)
    a, b = a_all[rank].npu(), b.npu()
    with pytest.raises(RuntimeError, match="HCCL_BUFFSIZE"):
        gar.gemm_allreduce(a, b, algorithm="fused")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = gar.gemm_allreduce(a, b, algorithm="auto")
    assert any("HCCL_BUFFSIZE" in str(w.message) for w in caught), [str(w.message) for w in caught]
    _check_close(out[rows.npu()], expected, world, "auto fallback to chunked")


def _failures_after_warmup(gar, rank, world):
    """In-kernel rank agreement and poisoned outputs (docs/decisions/0004-rank-agreement-before-data-moves.md,
    docs/decisions/0005-bounded-waits-and-failure-reporting.md): after a warm-up call the ranks agree inside the
    kernels. Rank 1 calls with another M: every rank's output is NaN and check_errors() raises naming the field; then
    rank 1 passes a bad bias: it raises at once, the peers' outputs are NaN and their check_errors() names rank 1; then
    the group works again."""
    group = dist.group.WORLD
    a, b, bias, expected = _inputs(rank, world, 200, 256, 300, torch.float16, 700, True, True)
    a, b, bias = a.npu(), b.npu(), bias.npu()
    _check_close(gar.gemm_allreduce(a, b, group, bias=bias, algorithm="fused"), expected, world, "warm-up")
    out = gar.gemm_allreduce(a[: 199 if rank == 1 else 200], b, group, bias=bias, algorithm="fused")
    assert torch.isnan(out.float()).all(), "a call whose ranks disagree on M must leave NaN"
    with pytest.raises(RuntimeError, match="called with different M"):
        gar.check_errors()
    if rank == 1:
        with pytest.raises(ValueError, match="bias"):
            gar.gemm_allreduce(a, b, group, bias=bias[:-1], algorithm="fused")
    else:
        out = gar.gemm_allreduce(a, b, group, bias=bias, algorithm="fused")
        assert torch.isnan(out.float()).all(), "peers of a rank with bad arguments must leave NaN"
        with pytest.raises(RuntimeError, match="rank 1 rejected its arguments"):
            gar.check_errors()
    _check_close(gar.gemm_allreduce(a, b, group, bias=bias, algorithm="fused"), expected, world, "after failures")


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("check", ("_every_algorithm", "_back_to_back_fused", "_three_d_input", "_window_too_small",
                                   "_failures_after_warmup", "_add_rmsnorm_every_algorithm"))
def test_npu_gemm_allreduce(world, check, tmp_path):
    _needs_devices(world)
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), check), nprocs=world, join=True)
