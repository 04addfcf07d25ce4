"""Inputs and float64 references shared by the multi-rank tests: every rank can rebuild every rank's shard from the
seed, so each rank checks the reduced result on its own."""
import hashlib

import torch

# Relative tolerance per dtype, applied to values of magnitude ~sqrt(K * world) (sums of unit-variance products).
TOLERANCE = {torch.float64: 1e-10, torch.float32: 3e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}

# Shapes that are not multiples of any tile size: (M, K, N).
ODD_SHAPES = [
    (1, 1, 1), (7, 33, 65), (129, 300, 777), (1000, 33, 65), (7, 300, 1), (1, 33, 777), (129, 1, 65), (1000, 300, 777),
]


def shard(seed: int, rank: int, m: int, k: int, dtype, three_d: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    a = torch.randn(m, k, generator=g, dtype=torch.float64).to(dtype)
    if three_d and m % 2 == 0 and m > 0:
        a = a.reshape(2, m // 2, k)
    return a


def weight(seed: int, k: int, n: int, dtype, transposed: bool) -> torch.Tensor:
    """b = [K, N]; transposed=True gives weight.t() of an nn.Linear-style [N, K] tensor (a non-contiguous view)."""
    g = torch.Generator().manual_seed(seed * 7919 + 100_003)
    if transposed:
        return torch.randn(n, k, generator=g, dtype=torch.float64).to(dtype).t()
    return torch.randn(k, n, generator=g, dtype=torch.float64).to(dtype)


def bias_vector(seed: int, n: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + 200_003)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def reference(shards, b, bias=None) -> torch.Tensor:
    out = sum(a.double().reshape(-1, a.shape[-1]) @ b.double() for a in shards)
    if bias is not None:
        out = out + bias.double()
    return out.reshape(*shards[0].shape[:-1], b.shape[1])


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype, k: int, world: int, what: str):
    assert out.dtype == dtype, f"{what}: dtype {out.dtype}, expected {dtype}"
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    tol = TOLERANCE[dtype]
    scale = (max(k, 1) * world) ** 0.5 + 1.0
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def assert_matches_sum_of_partials(out: torch.Tensor, shards, b: torch.Tensor, bias, dtype, k: int, what: str,
                                   reduced_in_dtype: bool = False):
    """assert_matches, with room for what a 2-byte partial costs: where bf16/fp16 are computed natively each rank's
    partial a_r @ b is rounded to the dtype before the ranks' sum (as in torch's matmul + all_reduce), an error of up
    to half a unit in the last place of |a_r @ b| per rank, which cancelling partials keep while the sum shrinks
    (e.g. at K=1 two partials of about 13 may sum to 0.05). Elementwise bound: assert_matches' plus that term.
    reduced_in_dtype: the collective itself adds in the dtype (gloo's all_reduce of bf16), so each of its world - 1
    additions rounds too, to half a unit of a partial sum, which the same sum of magnitudes bounds: `world` such
    terms in all (the partials' rounding and the additions')."""
    ref = reference(shards, b, bias)
    assert out.dtype == dtype and out.shape == ref.shape, f"{what}: {out.dtype} {tuple(out.shape)}"
    tol = TOLERANCE[dtype]
    world = len(shards)
    bound = torch.full_like(ref, tol * ((max(k, 1) * world) ** 0.5 + 1.0)) + tol * ref.abs()
    if dtype in (torch.bfloat16, torch.float16):
        unit = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11  # half an ulp, relative
        magnitude = sum((a.double().reshape(-1, a.shape[-1]) @ b.double()).abs() for a in shards)
        roundings = world if reduced_in_dtype else 1
        bound = bound + roundings * unit * magnitude.reshape(ref.shape)
    err = (out.double() - ref).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (f"{what}: {int((err > bound).sum())} elements over the bound; worst at flat "
                                        f"index {worst}: |out - ref| {float(err.flatten()[worst]):.4g} > "
                                        f"{float(bound.flatten()[worst]):.4g}")


def digest(t: torch.Tensor) -> str:
    """Bitwise fingerprint, to check that every rank returned the same tensor."""
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
