"""The official inference code's activation numerics: the FP8 / FP4 quantisation of what enters
its FP8 / FP4 GEMMs and of what its attention caches hold (where the model applies them:
`config.Rounding`).

Every format quantises a bf16 tensor in blocks along its last dim, computing in fp32 from
`x.float()`; `amax` is a block's largest magnitude:

- **FP8 activation** (`act_quant`; the input of every FP8 / FP4 GEMM, the window KV): blocks of
  32; `s = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448)))`, the smallest power of two at or above
  that fp32 product (so an all-zero block has `s = 2^-22`); codes `e4m3(x / s)`, rounded to
  nearest even, saturating at +-448; the scale kept as e8m0.
- **FP4, e8m0 scale** (`fp4_quant(x, 32, "e8m0")`; the indexer's queries and keys): blocks of
  32; `s = 2^ceil(log2(max(amax, 6 * 2^-126) * fp32(1/6)))`; codes `e2m1(clamp(x / s, -6, 6))`.
- **FP4, e4m3 scale** (`fp4_quant(x, 16, "e4m3")`; the compressed KV): blocks of 16;
  `s = e4m3(max(amax, 6 * 2^-9) / 6)`, rounded to nearest even and saturating at 448: not a
  power of two, and possibly below `amax / 6`, where the clamp to +-6 saturates.

e2m1 rounds to nearest even on its grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} (0.25 -> 0, 0.75 -> 1,
1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4) and keeps the sign of a zero. A dequantised
value is `bf16(code * s)`, which is exact: a code times its scale has at most 5 significant bits.
So a quantise-dequantise in bf16 and the codes with their scales hold the same values, and
quantising a dequantised tensor again gives it back.

The model's forward computes with the scales in fp32 and keeps an e8m0 scale as its byte,
`exponent + 127`: the e8m0 dtype appears only in the views `act_quant` and `fp4_quant` return
(Inductor's CPU code generator has no e8m0 type).

The formats are the official inference code's `act_quant` and `fp4_act_quant`; where each is
applied is in `config.Rounding` and docs/model.md ("Numerics").
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41_compile.deepseek_v41.model.layers import StaticFloat
from dsv41_compile.deepseek_v41.model.quant import (
    BLOCK,
    E2M1_MAX,
    E4M3_MAX,
    e2m1_values,
    e8m0_powers,
)

__all__ = [
    "ACT_BLOCK",
    "KV_FP4_BLOCK",
    "act_dequant",
    "act_quant",
    "act_quant_dequant",
    "fp4_dequant",
    "fp4_quant",
    "fp4_quant_dequant",
    "fp4_rows",
    "fp4_rows_width",
    "fp8_rows",
    "fp8_rows_width",
    "from_fp4_rows",
    "from_fp8_rows",
]

ACT_BLOCK = BLOCK
"""Values per FP8 activation scale (the weights' block, as in the official code), and per FP4
scale of the indexer."""
KV_FP4_BLOCK = 16
"""Values per e4m3 scale of the compressed KV."""


def _fp32(x: float) -> StaticFloat:
    """`x` rounded to fp32 (so an fp32 tensor times it is the kernels' fp32 product), and a
    constant for torch.compile: a plain float a compiled layer reads from a module global
    becomes a symbolic input, which a layer traced once for many (`nested_compile_region`)
    cannot take."""
    return StaticFloat(torch.tensor(x, dtype=torch.float32).item())


_E4M3_MAX, _E2M1_MAX = _fp32(E4M3_MAX), _fp32(E2M1_MAX)
_FP8_AMAX_FLOOR = _fp32(1e-4)
_E8M0_AMAX_FLOOR = _fp32(E2M1_MAX * 2.0**-126)
_E4M3_AMAX_FLOOR = _fp32(E2M1_MAX * 2.0**-9)
# The official kernels multiply by the fp32 reciprocal of the format's largest value.
_INV_E4M3_MAX, _INV_E2M1_MAX = _fp32(1 / E4M3_MAX), _fp32(1 / E2M1_MAX)


def _blocks(x: Tensor, block: int) -> Tensor:
    """`x` as fp32 `[..., n / block, block]`; `x` must be bf16 with `block` dividing n."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the official activation quantisation takes bf16, got {x.dtype}")
    if x.shape[-1] % block:
        raise ValueError(f"a last dim of {x.shape[-1]} is not a whole number of {block}-blocks")
    return x.float().unflatten(-1, (-1, block))


def _power_of_two_at_least(x: Tensor) -> tuple[Tensor, Tensor]:
    """The smallest power of two >= `x` (positive, normal fp32), exactly, and its e8m0 byte:
    `x = m * 2^e` with m in [0.5, 1) gives `2^(e-1)` when m is 0.5 and `2^e` otherwise. (A log2
    in fp32 rounds values just above a power of two down onto it.)"""
    mantissa, exponent = torch.frexp(x)
    exponent = exponent - (mantissa == 0.5).int()
    return torch.ldexp(torch.ones_like(x), exponent), (exponent + 127).to(torch.uint8)


def _to_e4m3(x: Tensor) -> Tensor:
    """fp32 -> float8_e4m3fn, rounded to nearest even, saturating at +-448 (a cast alone may
    give NaN above 464)."""
    return x.clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)


def _fp8(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """e4m3 codes `[..., n / 32, 32]`, fp32 scales and their e8m0 bytes `[..., n / 32]`."""
    x_BK = _blocks(x, ACT_BLOCK)
    amax_B = x_BK.abs().amax(-1).clamp_min(_FP8_AMAX_FLOOR)
    s_B, byte_B = _power_of_two_at_least(amax_B * _INV_E4M3_MAX)
    return _to_e4m3(x_BK / s_B[..., None]), s_B, byte_B


def act_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """FP8 codes and scales of bf16 `x [..., n]` (module docstring): float8_e4m3fn `[..., n]`
    and float8_e8m0fnu `[..., n / 32]`."""
    codes_BK, _, byte_B = _fp8(x)
    return codes_BK.flatten(-2), byte_B.view(torch.float8_e8m0fnu)


def _fp8_values(codes: Tensor, s_B: Tensor) -> Tensor:
    values_BK = codes.float().unflatten(-1, (-1, ACT_BLOCK)) * s_B[..., None]
    return values_BK.flatten(-2).to(torch.bfloat16)


def act_dequant(codes: Tensor, scales: Tensor) -> Tensor:
    """bf16 `codes * scale`, each scale over 32 codes: the inverse of `act_quant`."""
    return _fp8_values(codes, e8m0_powers(scales.view(torch.uint8)))


@torch.library.custom_op("dsv41::act_quant_dequant", mutates_args=())
def act_quant_dequant(x: Tensor) -> Tensor:
    """bf16 `x` through FP8 and back: what the official FP8 / FP4 GEMMs multiply. One opaque
    node: each row's blocks of 32 are quantised on their own, so the compiler places it by a
    rule of its own, and can move the FP8 rows a collective would feed it (`fp8_rows`)."""
    codes_BK, s_B, _ = _fp8(x)
    return (codes_BK.float() * s_B[..., None]).flatten(-2).to(torch.bfloat16)


@act_quant_dequant.register_fake
def _(x: Tensor) -> Tensor:
    torch._check(x.dtype == torch.bfloat16, lambda: f"FP8 quantisation takes bf16, got {x.dtype}")
    torch._check(
        x.shape[-1] % ACT_BLOCK == 0,
        lambda: (
            f"FP8 quantisation takes whole blocks of {ACT_BLOCK} values along the last dim, got "
            f"{x.shape[-1]}: a tp split of that dim must leave whole blocks on each rank"
        ),
    )
    return torch.empty_like(x)


def _e2m1(v: Tensor) -> Tensor:
    """fp32 `v` in [-6, 6] rounded to nearest even on the e2m1 grid, the sign of a zero kept:
    the grid's spacing is 0.5 below 2, 1 below 4 and 2 up to 6, and `round` of `|v| / spacing`
    ties to the even multiple, which is the even code."""
    magnitude = v.abs()
    spacing = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    return torch.copysign(torch.round(magnitude / spacing) * spacing, v)


def _e2m1_codes(r: Tensor) -> Tensor:
    """The 4-bit codes (uint8, bit 3 the sign) of values `r` on the e2m1 grid."""
    magnitude = r.abs()
    code = torch.where(
        magnitude < 2, 2 * magnitude, torch.where(magnitude < 4, magnitude + 2, magnitude / 2 + 4)
    )
    return code.to(torch.uint8) | (torch.signbit(r).to(torch.uint8) << 3)


def _fp4(x: Tensor, block: int, scale_format: str) -> tuple[Tensor, Tensor, Tensor]:
    """e2m1 values (fp32 on the grid) `[..., n / block, block]`, fp32 scales and the scales'
    bytes (e8m0 or e4m3) `[..., n / block]`."""
    x_BK = _blocks(x, block)
    amax_B = x_BK.abs().amax(-1)
    if scale_format == "e8m0":
        s_B, byte_B = _power_of_two_at_least(amax_B.clamp_min(_E8M0_AMAX_FLOOR) * _INV_E2M1_MAX)
    elif scale_format == "e4m3":
        scales_B = _to_e4m3(amax_B.clamp_min(_E4M3_AMAX_FLOOR) / _E2M1_MAX)
        s_B, byte_B = scales_B.float(), scales_B.view(torch.uint8)
    else:
        raise ValueError(f"an FP4 scale is 'e8m0' or 'e4m3', got {scale_format!r}")
    return _e2m1((x_BK / s_B[..., None]).clamp(-_E2M1_MAX, _E2M1_MAX)), s_B, byte_B


_SCALE_DTYPES = {"e8m0": torch.float8_e8m0fnu, "e4m3": torch.float8_e4m3fn}


def fp4_quant(x: Tensor, block: int, scale_format: str) -> tuple[Tensor, Tensor]:
    """FP4 codes and scales of bf16 `x [..., n]` (module docstring): packed e2m1 pairs, uint8
    `[..., n / 2]` with element 2k in the low nibble of byte k (the checkpoint's FP4 layout), and
    `[..., n / block]` scales, float8_e8m0fnu (`scale_format` "e8m0") or float8_e4m3fn ("e4m3")."""
    r_BK, _, byte_B = _fp4(x, block, scale_format)
    codes = _e2m1_codes(r_BK).flatten(-2)
    return codes[..., 0::2] | codes[..., 1::2] << 4, byte_B.view(_SCALE_DTYPES[scale_format])


def _fp4_values(packed: Tensor, s_B: Tensor, *, fresh_table: bool = False) -> Tensor:
    values = e2m1_values(packed, fresh_table=fresh_table)
    values_BK = values.unflatten(-1, (s_B.shape[-1], -1)) * s_B[..., None]
    return values_BK.flatten(-2).to(torch.bfloat16)


def fp4_dequant(packed: Tensor, scales: Tensor) -> Tensor:
    """bf16 `[..., 2 * packed.shape[-1]]`: the e2m1 values (decoded as the checkpoint's FP4
    weights are, `quant.e2m1_values`) times their scales (e8m0 or e4m3), each over
    `n / scales.shape[-1]` values: the inverse of `fp4_quant`."""
    if scales.dtype == torch.float8_e8m0fnu:
        return _fp4_values(packed, e8m0_powers(scales.view(torch.uint8)))
    return _fp4_values(packed, scales.float())


def fp4_quant_dequant(x: Tensor, block: int, scale_format: str) -> Tensor:
    """bf16 `x` through FP4 and back (`fp4_quant`)."""
    r_BK, s_B, _ = _fp4(x, block, scale_format)
    return (r_BK * s_B[..., None]).flatten(-2).to(torch.bfloat16)


# --- cache rows: codes and their scales, side by side in one byte row ------------------------


def fp8_rows_width(n: int) -> int:
    """Bytes of `fp8_rows` of n values: n e4m3 codes and n / 32 e8m0 scales."""
    return n + n // ACT_BLOCK


def fp8_rows(x: Tensor) -> Tensor:
    """bf16 `x [..., n]` as uint8 `[..., n + n / 32]`: its `act_quant` codes, then its scales."""
    codes_BK, _, byte_B = _fp8(x)
    return torch.cat((codes_BK.flatten(-2).view(torch.uint8), byte_B), dim=-1)


def from_fp8_rows(rows: Tensor) -> Tensor:
    """bf16 `[..., n]` from `fp8_rows` (`[..., n + n / 32]`)."""
    n = rows.shape[-1] * ACT_BLOCK // (ACT_BLOCK + 1)
    codes, scales = rows.split((n, n // ACT_BLOCK), dim=-1)
    return _fp8_values(codes.view(torch.float8_e4m3fn), e8m0_powers(scales))


# --- the same, as opaque ops: what a collective moves in place of bf16 rows -------------------


@torch.library.custom_op("dsv41::fp8_encode_rows", mutates_args=())
def fp8_encode_rows(x: Tensor) -> Tensor:
    """`fp8_rows(x)`, one node: the FP8 rows a collective moves instead of bf16 `x`."""
    return fp8_rows(x)


@fp8_encode_rows.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], fp8_rows_width(x.shape[-1])), dtype=torch.uint8)


@torch.library.custom_op("dsv41::fp8_decode_rows", mutates_args=())
def fp8_decode_rows(rows: Tensor) -> Tensor:
    """`from_fp8_rows(rows)`, one node: `act_quant_dequant` of the rows encoded."""
    return from_fp8_rows(rows)


@fp8_decode_rows.register_fake
def _(rows: Tensor) -> Tensor:
    n = rows.shape[-1] * ACT_BLOCK // (ACT_BLOCK + 1)
    return rows.new_empty((*rows.shape[:-1], n), dtype=torch.bfloat16)


def fp4_rows_width(n: int) -> int:
    """Bytes of `fp4_rows` of n values: n / 2 bytes of e2m1 pairs and n / 16 e4m3 scales."""
    return n // 2 + n // KV_FP4_BLOCK


def fp4_rows(x: Tensor) -> Tensor:
    """bf16 `x [..., n]` as uint8 `[..., n / 2 + n / 16]`: its e2m1 pairs, then its e4m3 scales
    (`fp4_quant(x, 16, "e4m3")`, the compressed KV's format)."""
    packed, scales = fp4_quant(x, KV_FP4_BLOCK, "e4m3")
    return torch.cat((packed, scales.view(torch.uint8)), dim=-1)


def from_fp4_rows(rows: Tensor) -> Tensor:
    """bf16 `[..., n]` from `fp4_rows` (`[..., n / 2 + n / 16]`)."""
    n = rows.shape[-1] * 2 * KV_FP4_BLOCK // (KV_FP4_BLOCK + 2)
    packed, scales = rows.split((n // 2, n // KV_FP4_BLOCK), dim=-1)
    # its table made here: the decode is traced inside `attention.sparse_attention_aten`
    return _fp4_values(packed, scales.view(torch.float8_e4m3fn).float(), fresh_table=True)
