"""gemm_allreduce_add_rmsnorm (docs/decisions/0011-add-rmsnorm-epilogue.md) on real rank processes: both outputs against
float64 references (world sizes 1-4, odd shapes, 3-D, bias, fp32/bf16/fp64, every algorithm), bitwise equal on every
rank; gradients of every input against a float64 autograd reference; bad residual/norm_weight on one rank or all;
torch.compile."""
import random

import pytest
import torch
import torch.distributed as dist

import torch_gemm_ar
from expect import raises
from rank0_gradcheck import gradcheck_on_rank0
from inputs import ODD_SHAPES, TOLERANCE, assert_matches, bias_vector, digest, reference, shard, weight


def residual_of(seed, shape, dtype):
    g = torch.Generator().manual_seed(seed * 7919 + 300_007)
    return (3 * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)


def norm_weight_of(seed, n, dtype):
    g = torch.Generator().manual_seed(seed * 7919 + 400_009)
    return (1 + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype)


def rms_norm64(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def odd_case(seed, case, world, dtype):
    """ODD_SHAPES[case] with bias, b transposed and 3-D inputs varying by case: every rank's shard, b, bias, the
    float64 reduction, residual and norm weight, and the flags."""
    m, k, n = ODD_SHAPES[case]
    with_bias, transposed, three_d = case % 2 == 0, case % 3 != 1, case % 4 == 3
    shards = [shard(seed + case, r, m, k, dtype, three_d) for r in range(world)]
    b = weight(seed + case, k, n, dtype, transposed)
    bias = bias_vector(seed + case, n, dtype) if with_bias else None
    ref_sum = reference(shards, b, bias)
    return (shards, b, bias, ref_sum, residual_of(seed + case, ref_sum.shape, dtype), norm_weight_of(seed + case, n, dtype),
            (with_bias, transposed, three_d))


def check_shapes(rank, world, seed, algorithm, dtype):
    digests = []
    eps = 1e-5
    for case, (m, k, n) in enumerate(ODD_SHAPES):
        shards, b, bias, ref_sum, residual, w, (with_bias, transposed, three_d) = odd_case(seed, case, world, dtype)
        out, normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm(shards[rank], b, residual, w, eps=eps, bias=bias,
                                                               algorithm=algorithm)
        what = f"{algorithm} {dtype} M={m} K={k} N={n} bias={with_bias} bT={transposed} 3d={three_d} rank={rank}"
        # out: the reduction's tolerance plus one more rounding (the residual's magnitude is ~3).
        assert_matches(out, ref_sum + residual.double(), dtype, k + 9, world, what + " out")
        # normed: RMSNorm of the returned `out`, in float64 (the reduction's own error is checked just above; this
        # keeps rows whose sum is near zero from amplifying it).
        tol = TOLERANCE[dtype]
        assert normed.shape == out.shape and normed.dtype == dtype, what
        torch.testing.assert_close(normed.double(), rms_norm64(out, w, eps), rtol=tol, atol=4 * tol,
                                   msg=lambda s: f"{what} normed: {s}")
        # The residual is an input, not written.
        torch.testing.assert_close(residual, residual_of(seed + case, ref_sum.shape, dtype), rtol=0, atol=0)
        digests.append(digest(out) + digest(normed))
    return digests


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("algorithm", ["sequential", "chunked", "fused", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_float64_reference(ranks, world, algorithm, dtype):
    digests = ranks(world).run(check_shapes, random.randrange(1 << 30), algorithm, dtype)
    assert all(d == digests[0] for d in digests), "ranks returned different tensors"


@pytest.mark.parametrize("world", [1, 2])
def test_matches_float64_reference_fp64(ranks, world):
    digests = ranks(world).run(check_shapes, random.randrange(1 << 30), "auto", torch.float64)
    assert all(d == digests[0] for d in digests), "ranks returned different tensors"


def full_chain_float64(rank, world, seed, algorithm):
    """float64 inputs: both outputs against the whole float64 chain (reduction, bias, add, norm) at once."""
    m, k, n, eps = 37, 19, 23, 1e-6
    shards = [shard(seed, r, m, k, torch.float64, True) for r in range(world)]
    b = weight(seed, k, n, torch.float64, True)
    bias = bias_vector(seed, n, torch.float64)
    ref_out = reference(shards, b, bias)
    residual = residual_of(seed, ref_out.shape, torch.float64)
    w = norm_weight_of(seed, n, torch.float64)
    ref_out = ref_out + residual
    out, normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm(shards[rank], b, residual, w, eps=eps, bias=bias,
                                                           algorithm=algorithm)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(normed, rms_norm64(ref_out, w, eps), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("algorithm", ["sequential", "fused"])
def test_full_chain_float64(ranks, world, algorithm):
    ranks(world).run(full_chain_float64, random.randrange(1 << 30), algorithm)


def emulated_row_bits(x_row, w, eps, dtype):
    """The epilogue's documented arithmetic for one row, emulated in IEEE fp32 with numpy: out = round(reduced +
    residual); square sums in 8 lanes (lane l: elements l, l+8, ... of the whole 8-blocks, the tail in lane 0),
    lanes summed 0..7; rstd = 1 / sqrt(sum / n + eps); normed = round((out * rstd) * w)."""
    import numpy as np

    f32 = np.float32
    xs = [f32(v) for v in x_row.float().tolist()]
    n = len(xs)
    lanes = [f32(0)] * 8
    whole = n - n % 8
    for i in range(whole):
        lanes[i % 8] = f32(lanes[i % 8] + f32(xs[i] * xs[i]))
    for i in range(whole, n):
        lanes[0] = f32(lanes[0] + f32(xs[i] * xs[i]))
    total = f32(0)
    for lane in lanes:
        total = f32(total + lane)
    rstd = f32(f32(1) / np.sqrt(f32(f32(total / f32(n)) + f32(eps))))
    ws = [f32(v) for v in w.float().tolist()]
    return torch.tensor([float(f32(f32(xs[j] * rstd) * ws[j])) for j in range(n)], dtype=torch.float32).to(dtype)


def epilogue_bits(rank, world, seed):
    """World 1 and b = identity, so the reduction is exactly `a`: `out` must be torch's rounding of a + residual
    (RNE, NaN -> NaN) and `normed` the emulated arithmetic, bitwise -- for the vectorised rows (fp32, the AVX2 bf16
    row)."""
    g = torch.Generator().manual_seed(seed)
    for dtype in (torch.float32, torch.bfloat16):
        for n in (37, 200, 2051):
            a = torch.randn(5, n, generator=g).to(dtype)
            residual = (torch.randn(5, n, generator=g) * 3).to(dtype)
            residual[2, 5] = float("nan")  # a NaN row: rounding must keep it NaN, as torch's does
            w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
            eye = torch.eye(n, dtype=dtype)
            want_out = (a.float() + residual.float()).to(dtype)
            out, normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm(a, eye, residual, w, eps=1e-5)
            what = f"{dtype} n={n}"
            bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
            finite = ~want_out.isnan()
            assert torch.equal(out.view(bits)[finite], want_out.view(bits)[finite]), what + ": out"
            assert out.isnan().equal(want_out.isnan()), what + ": NaNs of out"
            for r in (0, 4):  # rows without the NaN
                assert torch.equal(normed[r], emulated_row_bits(out[r], w, 1e-5, dtype)), f"{what}: normed row {r}"
            assert normed[2].isnan().all(), what + ": the NaN row normalises to NaN"


def test_epilogue_arithmetic_is_exactly_the_documented_one(ranks):
    ranks(1).run(epilogue_bits, random.randrange(1 << 30))


def empty_m(rank, world, algorithm):
    out, normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm(torch.randn(0, 5), torch.randn(5, 3), torch.randn(0, 3),
                                                           torch.ones(3), algorithm=algorithm)
    assert out.shape == normed.shape == (0, 3)


@pytest.mark.parametrize("algorithm", ["sequential", "fused"])
def test_empty_m(ranks, algorithm):
    ranks(2).run(empty_m, algorithm)


def grads_vs_float64(rank, world, seed, dtype, three_d, with_bias, outputs_used, algorithm):
    m, k, n, eps = 12, 9, 7, 1e-5
    shards = [shard(seed, r, m, k, dtype, three_d) for r in range(world)]
    weights = [weight(seed + r, k, n, dtype, transposed=True) for r in range(world)]
    bias = bias_vector(seed, n, dtype) if with_bias else None
    out_shape = (*shards[0].shape[:-1], n)
    residual = residual_of(seed, out_shape, dtype)
    w = norm_weight_of(seed, n, dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    up_out = torch.randn(*out_shape, generator=gen, dtype=torch.float64)
    up_normed = torch.randn(*out_shape, generator=gen, dtype=torch.float64)

    def loss(out, normed):
        total = 0
        if "out" in outputs_used:
            total = total + (out * up_out.to(out.dtype)).sum()
        if "normed" in outputs_used:
            total = total + (normed * up_normed.to(normed.dtype)).sum()
        return total

    inputs = [shards[rank], weights[rank], residual, w] + ([bias] if with_bias else [])
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    c = leaves[4] if with_bias else None
    out, normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm(leaves[0], leaves[1], leaves[2], leaves[3], eps=eps,
                                                           bias=c, algorithm=algorithm)
    loss(out, normed).backward()

    # float64 reference: this rank's product is differentiable, the others' are constants.
    refs = [t.detach().double().requires_grad_() for t in inputs]
    others = sum(shards[r].double() @ weights[r].double() for r in range(world) if r != rank)
    ref_out = refs[0] @ refs[1] + others + refs[2] + (refs[4] if with_bias else 0)
    loss(ref_out, rms_norm64(ref_out, refs[3], eps)).backward()
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    names = ["a", "b", "residual", "norm_weight", "bias"]
    for name, got, want in zip(names, leaves, refs):
        if want.grad is None:  # the path was not used (e.g. norm_weight when only `out` is)
            assert got.grad is None or torch.count_nonzero(got.grad) == 0, name
            continue
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=tol, atol=tol * 10,
                                   msg=lambda s: f"grad {name}: {s}")


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("three_d", [False, True])
def test_gradients_match_float64(ranks, world, dtype, three_d):
    pool = ranks(world)
    for outputs_used in (("out", "normed"), ("normed",), ("out",)):
        for with_bias in (True, False):
            pool.run(grads_vs_float64, random.randrange(1 << 30), dtype, three_d, with_bias, outputs_used,
                     "auto")


def gradcheck_rank0_inputs(rank, world, seed, algorithm):
    """gradcheck of rank 0's a, b, residual, norm_weight and bias while the other ranks contribute fixed shards."""
    a = shard(seed, rank, 5, 4, torch.float64)
    b = weight(seed + rank, 4, 3, torch.float64, transposed=True)
    bias = bias_vector(seed, 3, torch.float64)
    residual = residual_of(seed, (5, 3), torch.float64)
    w = norm_weight_of(seed, 3, torch.float64)

    def op(a_, b_, res_, w_, bias_):
        return torch_gemm_ar.gemm_allreduce_add_rmsnorm(a_, b_, res_, w_, eps=1e-3, bias=bias_, algorithm=algorithm)

    return gradcheck_on_rank0(rank, op, (a, b, residual, w, bias), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("world", [1, 2])
def test_gradcheck_float64(ranks, world):
    assert all(ranks(world).run(gradcheck_rank0_inputs, random.randrange(1 << 30), "sequential"))


def every_rank_bad(rank, world):
    a, b = torch.randn(8, 5), torch.randn(5, 3)
    res, w = torch.randn(8, 3), torch.ones(3)
    g = torch_gemm_ar.gemm_allreduce_add_rmsnorm
    raises(lambda: g(a, b, torch.randn(8, 4), w), "residual must have shape", "[8, 3]", exc=ValueError)
    raises(lambda: g(a, b, torch.randn(2, 4, 3), w), "residual must have shape", exc=ValueError)
    raises(lambda: g(a, b, res.double(), w), "residual must have the dtype", exc=ValueError)
    raises(lambda: g(a, b, res, torch.ones(4)), "norm_weight must be 1-D [N]", "N=3", exc=ValueError)
    raises(lambda: g(a, b, res, torch.ones(1, 3)), "norm_weight must be 1-D", exc=ValueError)
    raises(lambda: g(a, b, res, w.bfloat16()), "norm_weight must have the dtype", exc=ValueError)
    raises(lambda: g(a, b, res, w, eps=-1.0), "eps must be", exc=ValueError)
    raises(lambda: g(a, b, res, w, eps=1e39), "eps must be", "float32", exc=ValueError)  # inf as a float
    raises(lambda: g(a, torch.randn(4, 3), res, w), "K=5", "K=4", exc=ValueError)  # gemm_allreduce's own checks
    raises(lambda: g(a, b, res, w, algorithm="fastest"), "algorithm must be one of", exc=ValueError)
    raises(lambda: g(a, b, res, torch.ones(3, device="meta")), "device")
    raises(lambda: g(a, b, torch.randn(8, 3, device="meta"), w), "device")
    # Still usable after all of that.
    out, normed = g(a, b, res, w, algorithm="sequential")
    assert out.shape == normed.shape == (8, 3)


@pytest.mark.parametrize("world", [1, 2])
def test_bad_arguments_on_every_rank(ranks, world):
    ranks(world).run(every_rank_bad)


def one_rank_bad(rank, world, case, algorithm):
    a, b = torch.randn(8, 5), torch.randn(5, 3)
    res, w = torch.randn(8, 3), torch.ones(3)
    if rank == 1:
        if case == "residual-shape":
            res = torch.randn(8, 4)
        elif case == "residual-dtype":
            res = res.double()
        elif case == "weight-shape":
            w = torch.ones(5)
        elif case == "weight-dtype":
            w = w.half()
    with pytest.raises(ValueError) as info:
        torch_gemm_ar.gemm_allreduce_add_rmsnorm(a, b, res, w, algorithm=algorithm)
    message = str(info.value)
    argument = "residual" if case.startswith("residual") else "norm_weight"
    if rank == 1:
        assert f"{argument} must" in message, message
    else:
        assert "rank 1" in message and argument in message, message
    # The group is still usable afterwards, with the same algorithm.
    out, normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm(torch.ones(2, 5), torch.ones(5, 3), torch.ones(2, 3),
                                                           torch.full((3,), 2.0), algorithm=algorithm)
    torch.testing.assert_close(out, torch.full((2, 3), 5.0 * world + 1))
    torch.testing.assert_close(normed, torch.full((2, 3), 2.0), rtol=1e-5, atol=1e-5)
    return message


@pytest.mark.parametrize("algorithm", ["chunked", "fused"])
@pytest.mark.parametrize("case", ["residual-shape", "residual-dtype", "weight-shape", "weight-dtype"])
def test_one_bad_rank_raises_everywhere(ranks, case, algorithm):
    messages = ranks(3).run(one_rank_bad, case, algorithm, timeout_s=60)
    assert all(messages), messages


def eps_differs(rank, world, algorithm):
    """Ranks passing different eps would return different `normed`: every rank raises the disagreement naming eps;
    a mixed call of this op and plain gemm_allreduce is a disagreement on the op."""
    a, b, res, w = torch.randn(6, 5), torch.randn(5, 3), torch.randn(6, 3), torch.ones(3)
    eps = 1e-6 if rank == 0 else 1e-5
    message = raises(lambda: torch_gemm_ar.gemm_allreduce_add_rmsnorm(a, b, res, w, eps=eps, algorithm=algorithm),
                     "disagree", "eps=1e-06", "eps=1e-05", exc=ValueError)
    if rank == 0:
        call = lambda: torch_gemm_ar.gemm_allreduce(a, b, algorithm=algorithm)  # noqa: E731
    else:
        call = lambda: torch_gemm_ar.gemm_allreduce_add_rmsnorm(a, b, res, w, algorithm=algorithm)  # noqa: E731
    raises(call, "disagree", "gemm_allreduce_add_rmsnorm", exc=ValueError)
    out, _ = torch_gemm_ar.gemm_allreduce_add_rmsnorm(a, b, res, w, eps=1e-6, algorithm=algorithm)  # still usable
    return message


@pytest.mark.parametrize("algorithm", ["sequential", "fused"])
def test_ranks_with_different_eps_disagree(ranks, algorithm):
    assert all(ranks(2).run(eps_differs, algorithm, timeout_s=60))


def compile_step_inputs(seed, step, world):
    """Step `step` of the compiled tests: every rank's [16 + step, 8] shard, the weight as an nn.Linear holds it
    ([6, 8]), the residual and the norm weight (fp32)."""
    shards = [shard(seed + step, r, 16 + step, 8, torch.float32) for r in range(world)]
    w = weight(seed + step, 8, 6, torch.float32, transposed=False).t().contiguous()
    return shards, w, residual_of(seed + step, (16 + step, 6), torch.float32), norm_weight_of(seed, 6, torch.float32)


def compiled_call(rank, world, seed):
    torch._dynamo.reset()
    group = dist.group.WORLD

    def block(x, w, residual, norm_weight):
        out, normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm(x, w.t(), residual, norm_weight, group, eps=1e-5)
        return out, torch.nn.functional.silu(normed)

    compiled = torch.compile(block, fullgraph=True)
    for step in range(3):
        shards, w, residual, nw = compile_step_inputs(seed, step, world)
        x = shards[rank].clone().requires_grad_()
        out, act = compiled(x, w, residual, nw)
        ref_out = sum(s.double() @ w.double().t() for s in shards) + residual.double()
        torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(act.double(), torch.nn.functional.silu(rms_norm64(ref_out, nw, 1e-5)),
                                   rtol=1e-5, atol=1e-5)
        (out.sum() + act.sum()).backward()
        x_ref = shards[rank].double().requires_grad_()
        others = sum(s.double() @ w.double().t() for r, s in enumerate(shards) if r != rank)
        o = x_ref @ w.double().t() + others + residual.double()
        (o.sum() + torch.nn.functional.silu(rms_norm64(o, nw, 1e-5)).sum()).backward()
        torch.testing.assert_close(x.grad.double(), x_ref.grad, rtol=1e-4, atol=1e-4)


def test_torch_compile_fullgraph(ranks):
    ranks(2).run(compiled_call, random.randrange(1 << 30), timeout_s=300)


def back_to_back_fused(rank, world, seed):
    """Many fused calls in a row, shapes changing (row blocks finish on different comm blocks each time): a lost or
    doubled row-block count would leave rows unnormalised or add the residual twice."""
    digests = []
    for step in range(24):
        m, k, n = 33 + 97 * step, 17 + step % 5, 65 + 61 * (step % 7)
        shards = [shard(seed + step, r, m, k, torch.float32) for r in range(world)]
        b = weight(seed + step, k, n, torch.float32, transposed=step % 2 == 0)
        ref_sum = reference(shards, b)
        residual = residual_of(seed + step, ref_sum.shape, torch.float32)
        w = norm_weight_of(seed + step, n, torch.float32)
        out, normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm(shards[rank], b, residual, w, algorithm="fused")
        assert_matches(out, ref_sum + residual.double(), torch.float32, k + 9, world, f"step {step} out")
        torch.testing.assert_close(normed.double(), rms_norm64(out, w, 1e-6), rtol=3e-5, atol=1e-4,
                                   msg=lambda s: f"step {step} normed: {s}")
        digests.append(digest(out) + digest(normed))
    return digests


@pytest.mark.parametrize("world", [2, 3])
def test_back_to_back_fused_stress(ranks, world):
    digests = ranks(world).run(back_to_back_fused, random.randrange(1 << 30), timeout_s=300)
    assert all(d == digests[0] for d in digests), "ranks returned different tensors"
