"""The owner's reduction (cpu/tile_kernels.h) alone: its AVX-512 loop (cpu/reduce_avx512.h, fp32 and bf16) must give
bitwise the portable loop's result (NaN payloads aside) (ranks on CPUs with and without AVX-512 agree only then), both must give
exactly the fp32 sum in rank order rounded once, and neither may write outside the rows and columns it was given. Fresh random inputs with the values
that break conversions: NaN (several payloads), infinities, signed zeros, subnormals, bf16 rounding ties, sums that
overflow; widths around the 16-lane vectors; 1 to 4 partials; with and without a bank and an addend in out."""
import random

import pytest
import torch

from engine_observation_build import observe

# (partials, out): the dtype pairs the AVX-512 loop takes.
PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]
WIDTHS = [1, 15, 16, 17, 31, 33, 257, 999]
SENTINEL = -12288.0  # exact in bf16 and fp32: what the columns and rows around the region hold before and after

needs_avx512 = pytest.mark.skipif("not observe.has_avx512_reduce()",  # evaluated when the test runs
                                  reason="this CPU has no AVX-512 F/BW/VL: the reduction runs the portable loop only")


def special_values(gen, shape):
    """fp32 values, a quarter of them the awkward ones."""
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-20, 20, shape, generator=gen).float())
    awkward = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -3e-39, 3.0e38, -3.0e38,
                            1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8)])  # ties: exactly half a bf16 ulp
    bits = torch.tensor([0x7FC00001, 0xFFA00000, 0x7F800001, 0x3F808000, 0x3F818000], dtype=torch.int64)
    awkward = torch.cat([awkward, bits.to(torch.int32).view(torch.float32)])  # NaN payloads, more ties
    pick = torch.randint(0, 4, shape, generator=gen) == 0
    choice = awkward[torch.randint(0, len(awkward), shape, generator=gen)]
    return torch.where(pick, choice, x)


def padded(values, dtype, pad_rows=2, pad_cols=5):
    """`values` inside a larger buffer of sentinels (a view with a row stride wider than its columns)."""
    rows, cols = values.shape
    buffer = torch.full((rows + 2 * pad_rows, cols + 2 * pad_cols), SENTINEL, dtype=dtype)
    view = buffer[pad_rows:pad_rows + rows, pad_cols:pad_cols + cols]
    view.copy_(values.to(dtype))
    return buffer, view


def as_bits(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def same_bits(a, b):
    """Bit for bit, except that a NaN may carry another payload (fp32 outputs keep a payload of one of the NaNs
    summed, and which one depends on the operand order the compiler picked; bf16 outputs make every NaN 0x7FC0)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(as_bits(a)[~nan], as_bits(b)[~nan])


def run(partials, out0, bank_wanted, add_into_out, avx512, out_dtype):
    out_buffer, out = padded(out0, out_dtype)
    bank_buffer, bank = padded(torch.zeros_like(out0), out_dtype) if bank_wanted else (None, None)
    observe.reduce_rows(partials, out, bank, add_into_out, avx512)
    return out_buffer, bank_buffer


def outside(buffer, pad_rows=2, pad_cols=5):
    mask = torch.ones(buffer.shape, dtype=torch.bool)
    mask[pad_rows:buffer.shape[0] - pad_rows, pad_cols:buffer.shape[1] - pad_cols] = False
    return buffer[mask]


def cases(seed):
    gen = torch.Generator().manual_seed(seed)
    for partial_dtype, out_dtype in PAIRS:
        for world in (1, 2, 3, 4):
            for cols in WIDTHS:
                rows = random.Random(seed + cols).randint(1, 6)
                # Partials in one buffer each with a row stride wider than cols, as in the windows.
                partials = [padded(special_values(gen, (rows, cols)), partial_dtype, 0, 3)[1] for _ in range(world)]
                out0 = special_values(gen, (rows, cols))
                for bank_wanted in (True, False):
                    for add_into_out in (False, True):
                        yield partials, out0, bank_wanted, add_into_out, partial_dtype, out_dtype


@needs_avx512
def test_avx512_loop_is_bitwise_the_portable_loop():
    seed = random.randrange(1 << 30)
    checked = 0
    for partials, out0, bank_wanted, add_into_out, partial_dtype, out_dtype in cases(seed):
        what = (f"seed {seed}: {len(partials)} {partial_dtype} partials of {tuple(partials[0].shape)} into "
                f"{out_dtype}, bank {bank_wanted}, add_into_out {add_into_out}")
        vector = run(partials, out0, bank_wanted, add_into_out, True, out_dtype)
        portable = run(partials, out0, bank_wanted, add_into_out, False, out_dtype)
        for got, want, name in zip(vector, portable, ("out", "bank")):
            if want is not None:
                assert same_bits(got, want), f"{what}: {name} differs from the portable loop"
        checked += 1
    assert checked == len(PAIRS) * 4 * len(WIDTHS) * 4


@pytest.mark.parametrize("avx512", [True, False], ids=["avx512_loop", "portable_loop"])
def test_both_loops_match_float64_and_stay_inside_their_rows(avx512):
    if avx512 and not observe.has_avx512_reduce():
        pytest.skip("this CPU has no AVX-512 F/BW/VL: the reduction runs the portable loop only")
    seed = random.randrange(1 << 30)
    for partials, out0, bank_wanted, add_into_out, partial_dtype, out_dtype in cases(seed):
        what = (f"seed {seed}: {len(partials)} {partial_dtype} partials of {tuple(partials[0].shape)} into "
                f"{out_dtype}, bank {bank_wanted}, add_into_out {add_into_out}, avx512 {avx512}")
        out_buffer, bank_buffer = run(partials, out0, bank_wanted, add_into_out, avx512, out_dtype)
        for buffer in (out_buffer, bank_buffer):
            if buffer is not None:
                assert (outside(buffer).float() == SENTINEL).all(), f"{what}: wrote outside its rows and columns"
        rows, cols = out0.shape
        out = out_buffer[2:2 + rows, 5:5 + cols]
        # Exactly torch's fp32 sum in rank order, rounded once to out's dtype (stricter than a float64 tolerance: the
        # loops promise these roundings); NaN and infinities where it has them.
        fp32_sum = partials[0].float()
        for p in partials[1:]:
            fp32_sum = fp32_sum + p.float()
        rounded = fp32_sum.to(out_dtype)
        if bank_buffer is not None:
            bank = bank_buffer[2:2 + rows, 5:5 + cols]
            torch.testing.assert_close(bank.double(), rounded.double(), rtol=0, atol=0, equal_nan=True,
                                       msg=lambda s: f"{what}: bank is not the rounded fp32 sum: {s}")
        want = (rounded.float() + out0.to(out_dtype).float()).to(out_dtype) if add_into_out else rounded
        torch.testing.assert_close(out.double(), want.double(), rtol=0, atol=0, equal_nan=True,
                                   msg=lambda s: f"{what}: out is not the rounded fp32 sum: {s}")


def test_a_loop_that_reorders_the_sum_would_be_caught():
    """Negative control for the bitwise comparison: summing in another rank order changes some bits of these
    inputs, so a vector loop that reassociated would fail test_avx512_loop_is_bitwise_the_portable_loop."""
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    small, other, big = (torch.randn(8, 999, generator=gen) * scale for scale in (1.0, 1.0, 1e7))
    in_order, reordered = torch.empty(8, 999), torch.empty(8, 999)
    observe.reduce_rows([small, other, big], in_order, None, False, True)
    observe.reduce_rows([small, big, other], reordered, None, False, True)
    assert not same_bits(in_order, reordered)
