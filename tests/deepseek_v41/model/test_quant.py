"""The checkpoint's number formats against values computed by hand."""

from __future__ import annotations

import pytest
import torch

from dsv41_compile.deepseek_v41.model.quant import (
    E2M1,
    dequantize_fp4,
    dequantize_fp8,
    e8m0_powers,
    e8m0_values,
)


def e8m0(*exponent_bytes: int) -> torch.Tensor:
    return torch.tensor(exponent_bytes, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def test_e8m0_bytes_are_powers_of_two_from_2_pow_minus_127_to_2_pow_127():
    values = e8m0_values(e8m0(0, 1, 126, 127, 128, 254), "s").tolist()
    assert values == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    # the same bytes as uint8 (how some loaders keep them)
    assert e8m0_values(torch.tensor([0, 127, 254], dtype=torch.uint8), "s").tolist() == [
        2.0**-127,
        1.0,
        2.0**127,
    ]


def test_the_unchecked_decoder_gives_every_power_of_two_exactly():
    exponent = torch.arange(255, dtype=torch.uint8)
    want = torch.exp2(exponent.double() - 127)
    assert torch.equal(e8m0_powers(exponent).double(), want)
    assert torch.equal(e8m0_values(exponent, "s").double(), want)


def test_a_nan_scale_is_refused_naming_the_tensor_and_where():
    scale = e8m0(127, 127, 127, 255).reshape(2, 2)
    with pytest.raises(ValueError) as error:
        e8m0_values(scale, "layers.3.attn.wq_a.scale")
    assert str(error.value) == (
        "layers.3.attn.wq_a.scale: scale byte 255 (NaN) at [1, 1], 1 in all: the checkpoint is "
        "damaged (a released scale is a power of two)"
    )
    with pytest.raises(ValueError, match="must be float8_e8m0fnu"):
        e8m0_values(torch.ones(2), "x.scale")  # a numeric copy of the scale: not bytes


def test_every_e2m1_code_with_the_even_input_in_the_low_nibble():
    # byte k holds codes 2k (low nibble) and 2k + 1 (high nibble): inputs 0..15 are codes 0..15
    packed = torch.tensor([[(2 * k + 1) << 4 | 2 * k for k in range(8)]], dtype=torch.uint8)
    got = dequantize_fp4(packed.view(torch.int8), e8m0(127).reshape(1, 1), torch.float32, "w")
    assert got.tolist() == [list(E2M1)]
    assert [torch.copysign(torch.tensor(1.0), v).item() for v in got[0, [0, 8]]] == [1.0, -1.0]
    assert E2M1 == (0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6)


def test_fp4_scales_each_run_of_32_inputs_and_a_short_last_run():
    # in = 40: inputs 0..31 take scale 0, inputs 32..39 (a short block) scale 1
    codes = torch.full((2, 40), 0x2)  # 1.0
    codes[1, 39] = 0xF  # -6.0
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8).view(torch.int8)
    scale = e8m0(128, 125, 127, 130).reshape(2, 2)  # 2, 1/4 ; 1, 8
    got = dequantize_fp4(packed, scale, torch.float32, "w")
    want = torch.tensor([[2.0] * 32 + [0.25] * 8, [1.0] * 32 + [8.0] * 7 + [-48.0]])
    assert torch.equal(got, want)


def test_fp8_blocks_of_32_by_32_with_short_last_blocks():
    # out = 33, in = 40: scale [2, 2]; row 32 and columns 32..39 are short blocks
    weight = torch.full((33, 40), 1.5).to(torch.float8_e4m3fn)
    weight[32, 39] = -448.0  # e4m3's largest magnitude
    weight[0, 0] = 0.015625  # 2^-6
    scale = e8m0(127, 131, 120, 128).reshape(2, 2)  # 1, 16 ; 2^-7, 2
    got = dequantize_fp8(weight, scale, torch.float32, "w")
    assert got[0, 0] == 2.0**-6 and got[31, 31] == 1.5
    assert got[0, 32] == 24.0 and got[31, 39] == 24.0
    assert got[32, 0] == 1.5 * 2.0**-7 and got[32, 31] == 1.5 * 2.0**-7
    assert got[32, 32] == 3.0 and got[32, 39] == -896.0
    assert dequantize_fp8(weight, scale, torch.bfloat16, "w").dtype == torch.bfloat16


def test_a_scale_that_does_not_match_its_weight_is_an_error():
    weight = torch.zeros(64, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError) as error:
        dequantize_fp8(weight, e8m0(127, 127).reshape(1, 2), torch.float32, "layers.0.attn.wkv")
    assert str(error.value) == (
        "layers.0.attn.wkv: scale of shape [1, 2] does not match its weight float8_e4m3fn "
        "[64, 64]: expected [2, 2] (one per 32 elements, rounded up)"
    )
    packed = torch.zeros(4, 32, dtype=torch.int8)  # in = 64
    with pytest.raises(ValueError, match=r"expected \[4, 2\]"):
        dequantize_fp4(packed, e8m0(127, 127, 127, 127).reshape(4, 1), torch.float32, "w2")
    with pytest.raises(ValueError, match="2-d float8_e4m3fn"):
        dequantize_fp8(torch.zeros(64, 64, dtype=torch.bfloat16), e8m0(1), torch.float32, "w")
