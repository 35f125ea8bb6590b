"""The released checkpoint's number formats, decoded to a float dtype.

- **FP8** (attention projections, shared experts, the indexer's `wq_b`): `X.weight` is
  `float8_e4m3fn` `[out, in]`; its sibling `X.scale` is e8m0 `[ceil(out/32), ceil(in/32)]`, one
  power of two per 32 x 32 block: `W[i, j] = e4m3(weight[i, j]) * scale[i // 32, j // 32]`.
- **FP4** (routed experts): `X.weight` is int8 `[out, in/2]`, two e2m1 codes per byte, input
  `2k` in the low nibble and `2k + 1` in the high one; `X.scale` is e8m0 `[out, ceil(in/32)]`,
  one power of two per 32 inputs of a row.
- **e8m0** (`float8_e8m0fnu`) is an exponent byte: `2^(byte - 127)`, from `2^-127` (byte 0) to
  `2^127` (byte 254); byte 255 is NaN, which a checkpoint never holds on purpose: refused. A
  scale is read through its bytes (`.view(torch.uint8)`), never converted numerically into
  another integer dtype (that turns `2^-7` into 0).

A block at the end of a row or column may be short (`out` or `in` not a multiple of 32): its
scale covers the elements there are. Every error names the tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from dsv41_compile.formats import E2M1, e2m1_values, e8m0_powers

__all__ = [
    "BLOCK",
    "CODECS",
    "E2M1",
    "E2M1_MAX",
    "E4M3_MAX",
    "Codec",
    "dequantize_fp4",
    "dequantize_fp8",
    "e2m1_values",
    "e8m0_powers",
    "e8m0_values",
    "fp4_error_bound",
    "fp8_error_bound",
    "quantize_fp4",
    "quantize_fp8",
]

BLOCK = 32
"""Elements per scale along each blocked dimension."""

E4M3_MAX, E2M1_MAX = 448.0, 6.0
"""The largest magnitudes of e4m3 (`float8_e4m3fn`) and of e2m1."""


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _per_element(
    s: torch.Tensor, shape: torch.Size, rows: int, start: tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """Block values `s` spread over a weight of `shape`: one per `rows` x `BLOCK` elements
    (a short last block keeps the elements there are). `start`: the weight is the part of a
    larger one beginning at that element, and `s` holds the blocks it touches."""
    out, inp = shape
    r0, c0 = start[0] % rows, start[1] % BLOCK
    return s.repeat_interleave(rows, 0)[r0 : r0 + out].repeat_interleave(BLOCK, 1)[:, c0 : c0 + inp]


def e8m0_values(scale: torch.Tensor, name: str, first: tuple[int, ...] = (0, 0)) -> torch.Tensor:
    """The fp32 powers of two an e8m0 scale stands for (`float8_e8m0fnu`, or its bytes as
    uint8). A NaN byte (255) is an error naming `name` and the first index holding one
    (`first`: the index of `scale[0, 0]` in the whole scale, when `scale` is a part of it)."""
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise ValueError(
            f"{name}: an e8m0 scale must be float8_e8m0fnu (or its bytes as uint8), "
            f"got {scale.dtype}"
        )
    exponent = scale.view(torch.uint8)
    nan = exponent == 255
    if bool(nan.any()):
        at = [i + f for i, f in zip(nan.nonzero()[0].tolist(), first)]
        raise ValueError(
            f"{name}: scale byte 255 (NaN) at {at}, {int(nan.sum())} in all: the checkpoint "
            "is damaged (a released scale is a power of two)"
        )
    return e8m0_powers(exponent)


def _check_scale(scale: torch.Tensor, expected: tuple[int, ...], weight: str, name: str) -> None:
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"{name}: scale of shape {list(scale.shape)} does not match its weight {weight}: "
            f"expected {list(expected)} (one per {BLOCK} elements, rounded up)"
        )


def dequantize_fp8(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    name: str,
    start: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """`weight` (`float8_e4m3fn [out, in]`) times its 32 x 32 block scales, as `dtype`.
    `start`: `weight` is the part of a larger weight that begins at that element (a rank's
    slice), and `scale` the rows and columns of blocks it touches."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(
            f"{name}: an FP8 weight is a 2-d float8_e4m3fn tensor, got {weight.dtype} "
            f"{list(weight.shape)}"
        )
    (out, inp), (r, c) = weight.shape, start
    expected = (_blocks(r + out) - r // BLOCK, _blocks(c + inp) - c // BLOCK)
    _check_scale(scale, expected, f"float8_e4m3fn {[out, inp]}", name)
    values = e8m0_values(scale, name, (r // BLOCK, c // BLOCK))
    return (weight.float() * _per_element(values, weight.shape, BLOCK, start)).to(dtype)


def dequantize_fp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    name: str,
    start: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """`packed` (int8 `[out, in/2]`, two e2m1 codes per byte) times its per-32-input scales,
    as `dtype` `[out, in]`. `start`: `packed` is rows `start[0]...` of a larger weight (whole
    rows: `start[1]` is 0), and `scale` the same rows of its scale."""
    if packed.dtype not in (torch.int8, torch.uint8) or packed.dim() != 2:
        raise ValueError(
            f"{name}: an FP4 weight is a 2-d int8 tensor of packed e2m1 pairs, got "
            f"{packed.dtype} {list(packed.shape)}"
        )
    if start[1]:
        raise NotImplementedError(f"{name}: an FP4 weight is decoded in whole rows")
    out, inp = packed.shape[0], 2 * packed.shape[1]
    _check_scale(scale, (out, _blocks(inp)), f"int8 {list(packed.shape)} (in = {inp})", name)
    values = e2m1_values(packed)
    scales = e8m0_values(scale, name, (start[0], 0))
    return (values * _per_element(scales, values.shape, 1)).to(dtype)


# --- the inverse, for synthetic checkpoints (tools/make_checkpoint.py) -----------------------


def _block_exponents(amax: torch.Tensor, top: float) -> torch.Tensor:
    """Per block, the e8m0 byte of the smallest power of two `s` with `amax / s <= top`."""
    e = torch.ceil(torch.log2(amax.clamp(min=2.0**-120) / top))
    return (e + 127).clamp(0, 254).to(torch.uint8)


def _per_block_amax(w: torch.Tensor, rows: int) -> torch.Tensor:
    """The largest magnitude of each `rows` x `BLOCK` block of `w` (zero-padded to whole
    blocks)."""
    out, inp = w.shape
    padded = torch.zeros(-(-out // rows) * rows, _blocks(inp) * BLOCK)
    padded[:out, :inp] = w.abs()
    return padded.unflatten(0, (-1, rows)).unflatten(-1, (-1, BLOCK)).amax((1, 3))


def quantize_fp8(w: torch.Tensor, rows: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [out, in]` as the released FP8 pair: (float8_e4m3fn weight, e8m0 scale per `rows` x
    32 block: 32 x 32 for a linear's weight, 1 x 32 for an Engram table's rows), each block
    scaled so its largest magnitude fits e4m3."""
    w = w.float()
    scale = _block_exponents(_per_block_amax(w, rows), E4M3_MAX).view(torch.float8_e8m0fnu)
    s = _per_element(e8m0_values(scale, "scale"), w.shape, rows)
    return (w / s).to(torch.float8_e4m3fn), scale


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [out, in]` (even `in`) as the released FP4 pair: (int8 `[out, in/2]` of e2m1 codes,
    e8m0 scale per 32 inputs), each code the nearest e2m1 value (ties to the lower code)."""
    w = w.float()
    scale = _block_exponents(_per_block_amax(w, 1), E2M1_MAX).view(torch.float8_e8m0fnu)
    y = w / _per_element(e8m0_values(scale, "scale"), w.shape, 1)
    grid = torch.tensor(E2M1[:8])
    magnitude = (y.abs().unsqueeze(-1) - grid).abs().argmin(-1)
    codes = magnitude | ((y < 0).int() << 3)
    packed = codes[:, 0::2] | codes[:, 1::2] << 4
    return packed.to(torch.uint8).view(torch.int8), scale


def fp8_error_bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per element, the most `quantize_fp8` may move `w` by: half the e4m3 spacing at
    `|w| / s` (3 mantissa bits; subnormal spacing below 2^-6), times the block's scale."""
    s = _per_element(e8m0_values(scale, "scale"), w.shape, BLOCK)
    y = (w.float() / s).abs()
    octave = torch.floor(torch.log2(y.clamp(min=2.0**-6)))
    return torch.exp2(octave - 3) / 2 * s


def fp4_error_bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per element, the most `quantize_fp4` may move `w` by: half the e2m1 spacing at
    `|w| / s` (0.5 below 2, 1 below 4, 2 up to 6), times the scale of its 32 inputs."""
    s = _per_element(e8m0_values(scale, "scale"), w.shape, 1)
    y = (w.float() / s).abs()
    spacing = torch.where(y < 2, 0.5, torch.where(y < 4, 1.0, 2.0))
    return spacing / 2 * s


class Codec(NamedTuple):
    """A released weight format: to it, from it, and how far the round trip may move a weight."""

    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    dequantize: Callable[..., torch.Tensor]
    """(weight, scale, dtype, name, start=(0, 0)) -> the weight as `dtype`."""
    error_bound: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    scale_shape: Callable[[Sequence[int]], tuple[int, int]]
    """The shape of the scale of a stored weight of this shape."""


CODECS = {
    "fp8": Codec(
        quantize_fp8, dequantize_fp8, fp8_error_bound, lambda s: (_blocks(s[0]), _blocks(s[1]))
    ),
    "fp4": Codec(
        quantize_fp4, dequantize_fp4, fp4_error_bound, lambda s: (s[0], _blocks(2 * s[1]))
    ),
}
"""The quantised formats by name: each weight stored in one has an e8m0 `.scale` sibling."""
