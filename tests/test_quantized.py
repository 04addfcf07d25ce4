"""Quantized gemm_allreduce (W8A8, W8A16) on real rank processes against the float64 sum of the dequantized partial
products: odd shapes, 3-D a, bias, per-tensor and per-token/per-channel scales, every out dtype; every rank returns
bitwise the same tensor; bad input on every rank or on one rank only raises a ValueError naming the argument on
every rank, and the group stays usable; W8A16's gradient with respect to a; the fake kernel's dtype and shape."""
import random

import pytest
import torch
import torch.distributed as dist

import torch_gemm_ar
from engine_observation_build import observe
from expect import raises
from inputs import ODD_SHAPES, digest
from scoped_env import scoped_env

OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Half a unit in the last place, relative: the result is the fp32 sum rounded once to its dtype.
HALF_ULP = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def generator(seed, rank, what):
    return torch.Generator().manual_seed(seed * 7919 + rank * 31 + what)


def int8_shard(seed, rank, shape):
    return torch.randint(-127, 128, shape, generator=generator(seed, rank, 1), dtype=torch.int8)


def scales(seed, rank, shape, what):
    """Positive fp32 scales of the magnitude int8 quantization gives unit-variance values (about 1/127)."""
    return (torch.rand(shape, generator=generator(seed, rank, what), dtype=torch.float64) * 0.02 + 0.002).float()


def case_inputs(seed, rank, world, m, k, n, scheme, a_dtype, per_row_a, per_row_b, three_d, transposed, with_bias,
                out_dtype):
    """This rank's (a, b, kwargs) and every rank's dequantized float64 partial, so each rank checks on its own."""
    lead = (2, m // 2) if three_d else (m,)
    g_b = generator(seed, 0, 2)
    b = (torch.randint(-127, 128, (n, k), generator=g_b, dtype=torch.int8).t() if transposed
         else torch.randint(-127, 128, (k, n), generator=g_b, dtype=torch.int8))
    b_scale = scales(seed, 0, (n,) if per_row_b else (), 3)
    result_dtype = out_dtype or (torch.bfloat16 if scheme == "w8a8" else a_dtype)
    bias = (torch.randn(n, generator=generator(seed, 0, 4), dtype=torch.float64).to(result_dtype)
            if with_bias else None)
    partials, magnitudes, mine = [], [], None
    for r in range(world):
        if scheme == "w8a8":
            a = int8_shard(seed, r, (*lead, k))
            a_scale = scales(seed, r, lead if per_row_a else (1,), 5)
            a_rows = a.double().reshape(-1, k)
            row_scale = (a_scale.double().reshape(-1, 1) if per_row_a else a_scale.double())
            partial = row_scale * (a_rows @ b.double()) * b_scale.double()
            magnitude = row_scale * (a_rows.abs() @ b.double().abs()) * b_scale.double()
            kwargs = dict(a_scale=a_scale, b_scale=b_scale)
        else:
            a = torch.randn((*lead, k), generator=generator(seed, r, 6), dtype=torch.float64).to(a_dtype)
            a_rows = a.double().reshape(-1, k)
            b_deq = b.double() * b_scale.double()
            partial, magnitude = a_rows @ b_deq, a_rows.abs() @ b_deq.abs()
            kwargs = dict(b_scale=b_scale)
        partials.append(partial)
        magnitudes.append(magnitude)
        if r == rank:
            mine = (a, kwargs)
    ref = sum(partials)
    if bias is not None:
        ref = ref + bias.double()
    a, kwargs = mine
    kwargs.update(bias=bias, out_dtype=out_dtype)
    return a, b, kwargs, ref.reshape(*lead, n), sum(magnitudes).reshape(*lead, n), result_dtype


def assert_close_to_dequantized(out, ref, magnitude, dtype, k, world, what, extra=0.0):
    """The fp32 partials (int32 products converted once for W8A8; an fp32 GEMM over K for W8A16) and the fp32 sum
    over `world` ranks err by at most a few fp32 units of the sum of magnitudes; the result's own rounding by half a
    unit of its dtype. `extra`: an earlier rounding's bound (elementwise), added."""
    assert out.dtype == dtype and out.shape == ref.shape, f"{what}: {out.dtype} {tuple(out.shape)}"
    bound = HALF_ULP[dtype] * ref.abs() + 2.0 ** -22 * (k + world + 2) * magnitude + extra + 1e-30
    err = (out.double() - ref).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (f"{what}: {int((err > bound).sum())} elements over the bound; worst at flat "
                                        f"index {worst}: {float(err.flatten()[worst]):.4g} > "
                                        f"{float(bound.flatten()[worst]):.4g}")


def portable_group(world):
    """A fresh group whose CPU engine is off (read when the group's engine is set up), as on ranks spread over hosts:
    the ranks agree over the process group, where a small sequential call's partial rides on the exchange."""
    with scoped_env(TORCH_GEMM_AR_CPU_ENGINE="0"):
        group = dist.new_group(list(range(world)))
        torch_gemm_ar.gemm_allreduce(torch.ones(1, 1), torch.ones(1, 1), group, algorithm="sequential")
    return group


def check_cases(rank, world, seed, algorithm, scheme, a_dtype, portable=False):
    digests = []
    group = portable_group(world) if portable else None
    products = observe.dequantized_product_calls()
    carried = observe.agreement_payload_calls()
    for case, (m, k, n) in enumerate(ODD_SHAPES):
        out_dtype = [None, *OUT_DTYPES][case % 4]
        options = dict(per_row_a=case % 2 == 0, per_row_b=case % 3 != 2, three_d=case % 4 == 1 and m % 2 == 0,
                       transposed=case % 3 != 1, with_bias=case % 2 == 1 or case == 0, out_dtype=out_dtype)
        a, b, kwargs, ref, magnitude, dtype = case_inputs(seed + case, rank, world, m, k, n, scheme, a_dtype,
                                                          **options)
        out = torch_gemm_ar.gemm_allreduce(a, b, group, algorithm=algorithm, **kwargs)
        what = (f"{scheme} a={a_dtype} {algorithm} portable={portable} M={m} K={k} N={n} {options} rank={rank} "
                f"seed={seed + case}")
        assert_close_to_dequantized(out, ref, magnitude, dtype, k, world, what)
        digests.append(digest(out))
    assert observe.dequantized_product_calls() > products, "the dequantized product never ran"
    if portable and algorithm == "sequential":  # (1, 1, 1) and the other small outputs fit the exchange's slots
        assert observe.agreement_payload_calls() > carried, "no quantized result rode on the agreement"
    if portable:
        dist.destroy_process_group(group)
    return digests


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("algorithm", ["sequential", "chunked", "auto"])
@pytest.mark.parametrize("scheme,a_dtype", [("w8a8", torch.int8), ("w8a16", torch.float32),
                                             ("w8a16", torch.bfloat16), ("w8a16", torch.float16)], ids=str)
def test_matches_float64_dequantized_reference(ranks, world, algorithm, scheme, a_dtype):
    digests = ranks(world).run(check_cases, random.randrange(1 << 30), algorithm, scheme, a_dtype)
    assert all(d == digests[0] for d in digests), "ranks returned different tensors"


@pytest.mark.parametrize("algorithm", ["sequential", "chunked"])
@pytest.mark.parametrize("scheme,a_dtype", [("w8a8", torch.int8), ("w8a16", torch.bfloat16)], ids=str)
def test_matches_over_the_process_group(ranks, algorithm, scheme, a_dtype):
    digests = ranks(3).run(check_cases, random.randrange(1 << 30), algorithm, scheme, a_dtype, True)
    assert all(d == digests[0] for d in digests), "ranks returned different tensors"


def one_rank(rank, world, seed):
    """A group of one rank: the local product, dequantized as on many ranks."""
    a, b, kwargs, ref, magnitude, dtype = case_inputs(seed, 0, 1, 37, 19, 11, "w8a8", torch.int8, True, True, False,
                                                      True, True, torch.float32)
    out = torch_gemm_ar.gemm_allreduce(a, b, **kwargs)
    assert_close_to_dequantized(out, ref, magnitude, dtype, 19, 1, "world 1")


def test_world_of_one(ranks):
    ranks(1).run(one_rank, random.randrange(1 << 30))


def fused_refused(rank, world):
    a, b = torch.ones(4, 8, dtype=torch.int8), torch.ones(8, 3, dtype=torch.int8)
    one = torch.ones(1)
    raises(lambda: torch_gemm_ar.gemm_allreduce(a, b, a_scale=one, b_scale=one, algorithm="fused"),
           "quantized calls (W8A8, W8A16) have no fused path yet", exc=RuntimeError)
    out = torch_gemm_ar.gemm_allreduce(a, b, a_scale=one, b_scale=one, algorithm="auto")
    torch.testing.assert_close(out, torch.full((4, 3), 8.0 * world, dtype=torch.bfloat16))


def test_fused_is_refused_on_every_rank(ranks):
    ranks(2).run(fused_refused)


def every_rank_bad(rank, world):
    g = torch_gemm_ar.gemm_allreduce
    a8, b8 = torch.ones(6, 5, dtype=torch.int8), torch.ones(5, 3, dtype=torch.int8)
    af = torch.randn(6, 5)
    a_scale, b_scale = torch.ones(6), torch.ones(3)
    raises(lambda: g(af, b8), "b is int8, so b_scale is required", "N=3", exc=ValueError)
    raises(lambda: g(a8, b8, b_scale=b_scale), "a is int8, so a_scale is required", "[6]", exc=ValueError)
    raises(lambda: g(a8, b8, a_scale=torch.ones(5), b_scale=b_scale), "a_scale must have a's leading shape", "[5]",
           exc=ValueError)
    raises(lambda: g(a8, b8, a_scale=a_scale.double(), b_scale=b_scale), "a_scale must be float32", exc=ValueError)
    raises(lambda: g(a8, b8, a_scale=a_scale, b_scale=torch.ones(4)), "b_scale must be [N]", "N=3", exc=ValueError)
    raises(lambda: g(af, b8, b_scale=b_scale.bfloat16()), "b_scale must be float32", exc=ValueError)
    raises(lambda: g(a8, torch.randn(5, 3), a_scale=a_scale, b_scale=b_scale), "a is int8 (W8A8), so b must be int8",
           exc=ValueError)
    raises(lambda: g(af, b8, a_scale=a_scale, b_scale=b_scale), "a_scale is only for int8 a", exc=ValueError)
    raises(lambda: g(af, torch.randn(5, 3), b_scale=b_scale), "b_scale is only for int8 b", exc=ValueError)
    raises(lambda: g(af.double(), b8, b_scale=b_scale), "b is int8, so a must be int8", "Double", exc=ValueError)
    raises(lambda: g(a8, b8, a_scale=a_scale, b_scale=b_scale, out_dtype=torch.int32), "out_dtype must be",
           exc=ValueError)
    raises(lambda: g(af, torch.randn(5, 3), out_dtype=torch.bfloat16), "out_dtype is only for quantized calls",
           exc=ValueError)
    raises(lambda: g(a8, b8, a_scale=a_scale, b_scale=b_scale, bias=torch.ones(3)),
           "bias must have the dtype of the result (out_dtype)", "BFloat16", exc=ValueError)
    # Still usable, with the old call form too.
    out = g(a8, b8, a_scale=a_scale, b_scale=b_scale, out_dtype=torch.float32, algorithm="sequential")
    torch.testing.assert_close(out, torch.full((6, 3), 5.0 * world))
    assert g(af, torch.randn(5, 3)).shape == (6, 3)


@pytest.mark.parametrize("world", [1, 2])
def test_bad_arguments_on_every_rank(ranks, world):
    ranks(world).run(every_rank_bad)


ONE_RANK_CASES = {
    # case: (what rank 1's own message says, what every other rank's says)
    "b_scale-missing": ("b_scale is required", "`b_scale`"),
    "a_scale-missing": ("a_scale is required", "`a_scale`"),
    "a_scale-shape": ("a_scale must have a's leading shape", "`a_scale`"),
    "b_scale-dtype": ("b_scale must be float32", "`b_scale`"),
    "float-b": ("so b must be int8", "`a` and `b`"),
    "out_dtype": ("disagree on dtype", "disagree on dtype"),
    "scale-kind": ("disagree on dtype", "disagree on dtype"),
    "scheme": ("disagree on dtype", "disagree on dtype"),
}


def one_rank_bad(rank, world, case, algorithm, portable=False):
    group = portable_group(world) if portable else None
    a, b = torch.ones(6, 5, dtype=torch.int8), torch.ones(5, 3, dtype=torch.int8)
    kwargs = dict(a_scale=torch.ones(6), b_scale=torch.ones(3), algorithm=algorithm)
    if rank == 1:
        if case == "b_scale-missing":
            del kwargs["b_scale"]
        elif case == "a_scale-missing":
            del kwargs["a_scale"]
        elif case == "a_scale-shape":
            kwargs["a_scale"] = torch.ones(7)
        elif case == "b_scale-dtype":
            kwargs["b_scale"] = torch.ones(3, dtype=torch.float16)
        elif case == "float-b":
            b = torch.ones(5, 3)
        elif case == "out_dtype":
            kwargs["out_dtype"] = torch.float16
        elif case == "scale-kind":
            kwargs["b_scale"] = torch.ones(1)
        elif case == "scheme":
            a = torch.ones(6, 5, dtype=torch.bfloat16)
            del kwargs["a_scale"]
    with pytest.raises(ValueError) as info:
        torch_gemm_ar.gemm_allreduce(a, b, group, **kwargs)
    message = str(info.value)
    own, others = ONE_RANK_CASES[case]
    if rank == 1 or own == others:
        assert own in message, message
    else:
        assert others in message and "rank 1" in message, message
    # The group is still usable afterwards, with the same algorithm.
    out = torch_gemm_ar.gemm_allreduce(torch.ones(2, 5, dtype=torch.int8), torch.ones(5, 3, dtype=torch.int8), group,
                                       a_scale=torch.ones(2), b_scale=torch.full((3,), 0.5), algorithm=algorithm,
                                       out_dtype=torch.float32)
    torch.testing.assert_close(out, torch.full((2, 3), 2.5 * world))
    if portable:
        dist.destroy_process_group(group)
    return message


@pytest.mark.parametrize("portable", [False, True], ids=["engine-windows", "process-group"])
@pytest.mark.parametrize("algorithm", ["sequential", "auto"])
@pytest.mark.parametrize("case", list(ONE_RANK_CASES))
def test_one_rank_bad_raises_everywhere(ranks, case, algorithm, portable):
    """Through both channels of the agreement: the CPU engine's window headers (ranks on one host) and the exchange
    over the process group (the engine off, as across hosts)."""
    messages = ranks(3).run(one_rank_bad, case, algorithm, portable, timeout_s=60)
    assert all(messages), messages


def w8a16_gradient(rank, world, seed, a_dtype):
    """d(sum(out * g))/da = g @ (b * b_scale)^T on every rank (the output is replicated, so is g)."""
    m, k, n = 13, 29, 7
    a = torch.randn(2, m, k, generator=generator(seed, rank, 7), dtype=torch.float64).to(a_dtype).requires_grad_()
    b = torch.randint(-127, 128, (n, k), generator=generator(seed, 0, 8), dtype=torch.int8).t()
    b_scale = scales(seed, 0, (n,), 9).requires_grad_()  # a frozen quantization constant: no gradient flows to it
    g = torch.randn(2, m, n, generator=generator(seed, 0, 10), dtype=torch.float64)
    out = torch_gemm_ar.gemm_allreduce(a, b, b_scale=b_scale, out_dtype=torch.float32)
    assert out.requires_grad and out.dtype == torch.float32
    out.backward(g.float())
    expected = g @ (b.double() * b_scale.double()).t()
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[a_dtype]
    assert a.grad.dtype == a_dtype
    torch.testing.assert_close(a.grad.double(), expected, rtol=tol, atol=tol * (n ** 0.5 + 1))
    assert b_scale.grad is None
    # W8A8: int8 tensors cannot require grad, so the output does not either.
    out8 = torch_gemm_ar.gemm_allreduce(torch.ones(3, k, dtype=torch.int8), b, a_scale=torch.ones(1),
                                        b_scale=torch.ones(1))
    assert not out8.requires_grad


@pytest.mark.parametrize("a_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_w8a16_gradient_wrt_a(ranks, a_dtype):
    ranks(2).run(w8a16_gradient, random.randrange(1 << 30), a_dtype)


@pytest.mark.parametrize(
    "a_dtype,kwargs,expected",
    [
        (torch.int8, {}, torch.bfloat16),
        (torch.int8, {"out_dtype": torch.float16}, torch.float16),
        (torch.bfloat16, {}, torch.bfloat16),
        (torch.float16, {"out_dtype": torch.float32}, torch.float32),
    ],
    ids=str,
)
def test_fake_kernel_gives_the_out_dtype(a_dtype, kwargs, expected):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(2, 5, 7, dtype=a_dtype)
        b = torch.empty(3, 7, dtype=torch.int8).t()
        scale = {"a_scale": torch.empty(2, 5)} if a_dtype == torch.int8 else {}
        out = torch.ops.pto.gemm_allreduce(a, b, "unused", b_scale=torch.empty(3), **scale, **kwargs)
    assert out.dtype == expected and tuple(out.shape) == (2, 5, 3)


def compiled(rank, world, seed):
    a, b, kwargs, ref, magnitude, dtype = case_inputs(seed, rank, world, 12, 33, 9, "w8a8", torch.int8, True, True,
                                                      True, True, True, None)
    fn = torch.compile(lambda x: torch_gemm_ar.gemm_allreduce(x, b, **kwargs), fullgraph=True)
    out = fn(a)
    assert_close_to_dequantized(out, ref, magnitude, dtype, 33, world, "compiled")
    return digest(out)


def test_compiles_without_graph_break(ranks):
    digests = ranks(2).run(compiled, random.randrange(1 << 30))
    assert digests[0] == digests[1]


def add_rmsnorm_cases(rank, world, seed, algorithm, scheme, a_dtype, in_place):
    """gemm_allreduce_add_rmsnorm(_) with quantized inputs: `out` against the float64 sum (rounded to the out dtype
    after the reduction, then again after the residual add), `normed` against RMSNorm of the returned `out`."""
    digests = []
    for case, (m, k, n) in enumerate([(7, 33, 65), (1, 1, 1), (129, 300, 777), (12, 5, 3)]):
        out_dtype = [None, *OUT_DTYPES][case % 4]
        options = dict(per_row_a=case % 2 == 0, per_row_b=case % 3 != 2, three_d=case == 3,
                       transposed=case % 2 == 0, with_bias=case % 2 == 1, out_dtype=out_dtype)
        a, b, kwargs, ref, magnitude, dtype = case_inputs(seed + case, rank, world, m, k, n, scheme, a_dtype,
                                                          **options)
        g = generator(seed + case, 0, 11)
        residual = torch.randn(ref.shape, generator=g, dtype=torch.float64).to(dtype)
        weight = (torch.rand(n, generator=g, dtype=torch.float64) + 0.5).to(dtype)
        if in_place:
            out = residual.clone()
            normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm_(a, b, out, weight, eps=1e-5, algorithm=algorithm,
                                                              **kwargs)
        else:
            out, normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm(a, b, residual, weight, eps=1e-5,
                                                                   algorithm=algorithm, **kwargs)
        what = f"add_rmsnorm {scheme} a={a_dtype} {algorithm} in_place={in_place} M={m} K={k} N={n} {options}"
        # The reduced sum is rounded to the out dtype once (half a unit of |ref|), then out = round(that + residual).
        assert_close_to_dequantized(out, ref + residual.double(), magnitude, dtype, k, world, what + " out",
                                    extra=HALF_ULP[dtype] * ref.abs())
        x = out.double()
        normed_ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
        tol = 4 * HALF_ULP[dtype]
        assert normed.dtype == dtype
        torch.testing.assert_close(normed.double(), normed_ref, rtol=tol, atol=tol, msg=lambda s: f"{what} normed: {s}")
        digests.append(digest(out) + digest(normed))
    return digests


@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
@pytest.mark.parametrize("algorithm", ["sequential", "auto"])
@pytest.mark.parametrize("scheme,a_dtype", [("w8a8", torch.int8), ("w8a16", torch.bfloat16)], ids=str)
def test_add_rmsnorm_matches_float64(ranks, algorithm, scheme, a_dtype, in_place):
    digests = ranks(3).run(add_rmsnorm_cases, random.randrange(1 << 30), algorithm, scheme, a_dtype, in_place)
    assert all(d == digests[0] for d in digests), "ranks returned different tensors"


def add_rmsnorm_bad(rank, world):
    a, b = torch.ones(6, 5, dtype=torch.int8), torch.ones(5, 3, dtype=torch.int8)
    scales = dict(a_scale=torch.ones(6), b_scale=torch.ones(3))
    residual, weight = torch.ones(6, 3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)
    op = torch_gemm_ar.gemm_allreduce_add_rmsnorm
    raises(lambda: op(a, b, residual.float(), weight, **scales), "residual must have the dtype of the result",
           exc=ValueError)
    raises(lambda: op(a, b, residual, weight, b_scale=scales["b_scale"]), "a_scale is required", exc=ValueError)
    if rank == 1:  # one rank alone without b_scale: every rank raises, naming it
        scales = dict(a_scale=scales["a_scale"])
    raises(lambda: op(a, b, residual, weight, **scales), "b_scale", exc=ValueError)
    out, normed = op(a, b, residual, weight, a_scale=torch.ones(6), b_scale=torch.ones(3))
    torch.testing.assert_close(out, torch.full((6, 3), 5.0 * world + 1, dtype=torch.bfloat16))


def test_add_rmsnorm_bad_arguments_raise_everywhere(ranks):
    ranks(3).run(add_rmsnorm_bad, timeout_s=60)


def add_rmsnorm_w8a16_gradient(rank, world, seed):
    """W8A16 gradients of gemm_allreduce_add_rmsnorm against float64 autograd of the same formula (own a varies,
    the peers' partials are constants)."""
    m, k, n = 9, 21, 6
    shards = [torch.randn(m, k, generator=generator(seed, r, 12), dtype=torch.float64).float() for r in range(world)]
    b = torch.randint(-127, 128, (n, k), generator=generator(seed, 0, 13), dtype=torch.int8).t()
    b_scale = scales(seed, 0, (n,), 14)
    residual = torch.randn(m, n, generator=generator(seed, 0, 15), dtype=torch.float64).float()
    weight = (torch.rand(n, generator=generator(seed, 0, 16), dtype=torch.float64) + 0.5).float()
    g_out, g_normed = (torch.randn(m, n, generator=generator(seed, 0, w), dtype=torch.float64) for w in (17, 18))
    a = shards[rank].clone().requires_grad_()
    res = residual.clone().requires_grad_()
    out, normed = torch_gemm_ar.gemm_allreduce_add_rmsnorm(a, b, res, weight, b_scale=b_scale, eps=1e-5)
    torch.autograd.backward([out, normed], [g_out.float(), g_normed.float()])
    a64 = shards[rank].double().requires_grad_()
    b_deq = b.double() * b_scale.double()
    total = sum((a64 if r == rank else shards[r].double()) @ b_deq for r in range(world)) + residual.double()
    normed64 = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    torch.autograd.backward([total, normed64], [g_out, g_normed])
    torch.testing.assert_close(a.grad.double(), a64.grad, rtol=1e-4, atol=1e-4)
    assert res.grad is not None


def test_add_rmsnorm_w8a16_gradient(ranks):
    ranks(2).run(add_rmsnorm_w8a16_gradient, random.randrange(1 << 30))


def npu_refuses_quantized(rank, world, library):
    """On the NPU host code (the emulated Ascend runtime), quantized arguments raise NotImplementedError on every rank,
    whether every rank or one rank alone passes them; the group keeps working."""
    import npu_emulated_ranks

    npu_emulated_ranks.load(library)
    group = npu_emulated_ranks.group(library, "mesh", key="quantized")
    a = torch.ones(6, 16, dtype=torch.float16)
    b8 = torch.ones(16, 8, dtype=torch.int8)

    def plain():
        out = torch_gemm_ar.gemm_allreduce(a.to("npu"), torch.ones(16, 8, dtype=torch.float16).to("npu"), group,
                                           algorithm="sequential").cpu()
        torch.testing.assert_close(out, torch.full((6, 8), 16.0 * world, dtype=torch.float16))

    plain()
    messages = []
    with pytest.raises(NotImplementedError) as info:  # every rank quantized
        torch_gemm_ar.gemm_allreduce(a.to("npu"), b8.to("npu"), group, b_scale=torch.ones(8).to("npu"))
    messages.append(str(info.value))
    plain()
    with pytest.raises(NotImplementedError) as info:  # rank 1 alone quantized
        if rank == 1:
            torch_gemm_ar.gemm_allreduce(a.to("npu"), b8.to("npu"), group, b_scale=torch.ones(8).to("npu"),
                                         algorithm="sequential")
        else:
            plain()
    messages.append(str(info.value))
    plain()
    return messages


def test_npu_refuses_quantized_arguments_on_every_rank(emulated_npu):
    library, pools = emulated_npu
    results = pools(2).run(npu_refuses_quantized, library)
    for rank, (every_rank, one_rank) in enumerate(results):
        assert "not implemented on npu" in every_rank, every_rank
        if rank == 1:
            assert "not implemented on npu" in one_rank, one_rank
        else:
            assert "rank 1" in one_rank and "not implemented" in one_rank, one_rank
