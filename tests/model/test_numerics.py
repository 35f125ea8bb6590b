"""The official numerics' FP8 / FP4 activation formats, against values computed by hand and
against the checkpoint's own decoders."""

from __future__ import annotations

import pytest
import torch

from dsv41_compile.model.numerics import (
    act_dequant,
    act_quant,
    act_quant_dequant,
    fp4_dequant,
    fp4_quant,
    fp4_quant_dequant,
    fp4_rows,
    fp8_rows,
    from_fp4_rows,
    from_fp8_rows,
)
from dsv41_compile.model.quant import dequantize_fp4, dequantize_fp8


def bf16(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bfloat16)


def padded_to(n: int, *values: float) -> torch.Tensor:
    """`values` then zeros: a block of n."""
    return torch.cat((bf16(*values), torch.zeros(n - len(values), dtype=torch.bfloat16)))


def exponent_bytes(scale: torch.Tensor) -> list[int]:
    return scale.view(torch.uint8).tolist()


# --- FP8 activations (act_quant) --------------------------------------------------------------


def test_fp8_scale_is_the_power_of_two_above_amax_over_448_and_codes_round_to_even():
    # amax 2.5: 2.5 / 448 = 2^-7.5, so s = 2^-7 (e8m0 byte 120)
    x = padded_to(32, 2.5, 1.0, -0.3, 0.001, 17 / 128, 19 / 128)
    codes, scales = act_quant(x)
    assert exponent_bytes(scales) == [127 - 7]
    # 2.5 * 128 = 320; 1 -> 128; bf16(-0.3) * 128 = -38.5 -> -40 (e4m3 steps of 4 in [32, 64));
    # bf16(0.001) * 128 = 0.1279 -> 0.125 (steps of 2^-6 in [2^-3, 2^-2)); 17 and 19 are ties
    # between steps of 2 in [16, 32): to the even mantissa, 16 and 20
    assert codes.float()[:6].tolist() == [320, 128, -40, 0.125, 16, 20]
    assert act_quant_dequant(x)[:6].tolist() == [2.5, 1.0, -0.3125, 2.0**-10, 0.125, 0.15625]
    assert torch.equal(act_dequant(codes, scales), act_quant_dequant(x))


def test_fp8_amax_just_above_448_times_a_power_of_two_doubles_the_scale():
    codes, scales = act_quant(torch.cat((padded_to(32, 448.0), padded_to(32, 450.0))))
    assert exponent_bytes(scales) == [127, 128]  # 448 / 448 = 1 exactly; 450 / 448 > 1
    assert codes.float()[[0, 32]].tolist() == [448, 224]  # 450 / 2 = 225 -> 224 (steps of 16)


def test_fp8_amax_floor_of_1e_minus_4():
    # An all-zero block and one of amax 2^-16 both take s = 2^ceil(log2(1e-4 / 448)) = 2^-22.
    x = torch.cat((padded_to(32), padded_to(32, 2.0**-16, 3 * 2.0**-32)))
    codes, scales = act_quant(x)
    assert exponent_bytes(scales) == [127 - 22, 127 - 22]
    # 3 * 2^-32 / 2^-22 = 1.5 * 2^-9, a tie between e4m3's subnormals 2^-9 and 2^-8: to the
    # even one, 2^-8, so it comes back as 2^-30 (without the floor, s = 2^-24 keeps it exact)
    assert codes.float()[33].item() == 2.0**-8
    assert act_quant_dequant(x)[[0, 32, 33]].tolist() == [0.0, 2.0**-16, 2.0**-30]


# --- FP4 e2m1: e4m3 scales per 16 (compressed KV), e8m0 scales per 32 (indexer) --------------


def test_fp4_with_e4m3_scales_per_16_rounds_to_nearest_even():
    grid = (6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -5, 0.1, 5.5, -1.75, 4.5, 3, 0)
    x = torch.cat(
        (
            bf16(*grid),  # amax 6: s = e4m3(6 / 6) = 1, the values are their own codes
            padded_to(16, 9.0, 4.5, 2.0),  # s = e4m3(1.5) = 1.5: not a power of two
            padded_to(16, 6.3, 1.0),  # s = e4m3(6.3125 / 6 = 1.052) = 1, below amax / 6
            padded_to(16),  # floor 6 * 2^-9: s = 2^-9, e4m3's least subnormal
        )
    )
    packed, scales = fp4_quant(x, 16, "e4m3")
    assert scales.float().tolist() == [1.0, 1.5, 1.0, 2.0**-9]
    got = fp4_quant_dequant(x, 16, "e4m3")
    # ties 0.25, 1.25, 2.5, 5 go down, 0.75, 1.75, 3.5 up: to the even code
    assert got[:16].tolist() == [6, 0, 1, 1, 2, 2, 4, 4, -0.0, -4, 0, 6, -2, 4, 3, 0]
    assert torch.signbit(got[8])  # -0.25 -> -0: the sign of zero is kept
    # 9 / 1.5 = 6, 4.5 / 1.5 = 3, 2 / 1.5 = 1.33 -> 1.5, times 1.5
    assert got[16:19].tolist() == [9.0, 4.5, 2.25]
    # 6.3125 / 1 saturates at 6 (the e4m3 scale rounded below amax / 6)
    assert got[32:34].tolist() == [6.0, 1.0]
    assert torch.equal(fp4_dequant(packed, scales), got)
    assert packed.dtype == torch.uint8 and packed.shape == (32,)


def test_fp4_e4m3_scale_saturates_at_448():
    x = padded_to(16, 4096.0, -4096.0)  # 4096 / 6 = 682.7 > 448: s = 448, not NaN
    _, scales = fp4_quant(x, 16, "e4m3")
    assert scales.float().tolist() == [448.0]
    assert fp4_quant_dequant(x, 16, "e4m3")[:2].tolist() == [6 * 448.0, -6 * 448.0]


def test_fp4_with_e8m0_scales_per_32():
    x = torch.cat((padded_to(32, 6.0, 0.75), padded_to(32, 6.0625, 5.0), padded_to(32)))
    _, scales = fp4_quant(x, 32, "e8m0")
    # 6 / 6 = 1 exactly: s = 1; 6.0625 / 6 > 1: s = 2; zeros: the floor 6 * 2^-126 gives 2^-126
    assert exponent_bytes(scales) == [127, 128, 1]
    got = fp4_quant_dequant(x, 32, "e8m0")
    assert got[[0, 1, 32, 33]].tolist() == [6.0, 1.0, 6.0, 4.0]  # 6.0625/2 -> 3; 5/2 = 2.5 -> 2


# --- through the checkpoint's own bytes -------------------------------------------------------


def test_round_trips_through_the_checkpoint_decoders_and_the_cache_rows():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 64, generator=gen) * torch.logspace(-6, 3, 6)[:, None]).bfloat16()
    x[0, :32] = 0.0

    # FP4 with e8m0 scales per 32 is the released FP4 weight format, byte for byte
    packed, scales = fp4_quant(x, 32, "e8m0")
    weight = dequantize_fp4(packed.view(torch.int8), scales, torch.bfloat16, "x")
    assert torch.equal(weight, fp4_quant_dequant(x, 32, "e8m0"))
    # FP8 codes and scales of a row are a one-row FP8 weight (its scale [1, n / 32])
    codes, scales = act_quant(x)
    rows = [
        dequantize_fp8(codes[i : i + 1], scales[i : i + 1], torch.bfloat16, "x") for i in range(6)
    ]
    assert torch.equal(torch.cat(rows), act_quant_dequant(x))

    # the cache rows hold the same values, in n + n/32 and n/2 + n/16 bytes
    assert fp8_rows(x).shape == (6, 66) and fp4_rows(x).shape == (6, 36)
    assert torch.equal(from_fp8_rows(fp8_rows(x)), act_quant_dequant(x))
    assert torch.equal(from_fp4_rows(fp4_rows(x)), fp4_quant_dequant(x, 16, "e4m3"))
    # a dequantised tensor quantises to itself
    for qdq in (
        act_quant_dequant,
        lambda t: fp4_quant_dequant(t, 16, "e4m3"),
        lambda t: fp4_quant_dequant(t, 32, "e8m0"),
    ):
        assert torch.equal(qdq(qdq(x)), qdq(x))


def test_the_formats_take_bf16_in_whole_blocks():
    with pytest.raises(ValueError, match="takes bf16, got torch.float32"):
        act_quant(torch.zeros(32))
    with pytest.raises(ValueError, match="a last dim of 48 is not a whole number of 32-blocks"):
        fp4_quant(torch.zeros(48, dtype=torch.bfloat16), 32, "e8m0")
