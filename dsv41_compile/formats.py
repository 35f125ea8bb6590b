"""The OCP microscaling (MX) element and scale formats the released weights and torch_npu's MX
ops share, decoded without a dtype of their own: e2m1 (4-bit floats, two per byte) and e8m0
(an exponent byte). Shared by the model (its FP4 experts, its FP8 block scales) and the CPU
stand-ins of torch_npu's MX ops; a leaf: it imports nothing of the package."""

from __future__ import annotations

import torch

__all__ = ["E2M1", "e2m1_table", "e2m1_values", "e8m0_powers"]

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit e2m1 code (bit 3 is the sign)."""

_E2M1_PAIRS = torch.tensor([[E2M1[b & 0xF], E2M1[b >> 4]] for b in range(256)])
"""Byte -> the values of its low and high nibble: one lookup decodes two inputs."""

aten = torch.ops.aten


def e2m1_values(packed: torch.Tensor, *, fresh_table: bool = False) -> torch.Tensor:
    """The fp32 values of packed e2m1 pairs (int8 or uint8 `[..., n]`, element `2k` in the low
    nibble of byte k): `[..., 2n]`. Unscaled; no checks (the callers check their shapes).
    `fresh_table`: the lookup table computed by this call from the codes' bits (`e2m1_table`),
    for code an op's decomposition runs, which AOTAutograd traces on fake tensors, where a
    tensor made before the trace cannot enter (`model.attention.sparse_attention_aten`)."""
    table = (
        e2m1_table(torch.arange(256, device=packed.device))
        if fresh_table
        else _E2M1_PAIRS.to(packed.device)
    )
    return table[packed.view(torch.uint8).long()].flatten(-2)


def e2m1_table(byte: torch.Tensor) -> torch.Tensor:
    """The values of the low and high nibble of each of `byte` (int64, `arange(256)`: the
    lookup table `e2m1_values` reads, [256, 2]), computed from the codes' bits: sign (bit 3),
    exponent (bits 2-1) and mantissa (bit 0); `m / 2` at exponent 0, else `(1 + m / 2)
    2^(e - 1)`. Written with ATen ops, so that a graph rewrite computes the same table from an
    FX proxy (`deepseek_v41.graph_mode.fp4_rows_decoded`)."""
    codes = aten.stack.default(
        [aten.remainder.Scalar(byte, 16), aten.floor_divide.default(byte, 16)], -1
    )
    magnitude = aten.remainder.Scalar(codes, 8)
    mantissa = aten._to_copy.default(aten.remainder.Scalar(magnitude, 2), dtype=torch.float32)
    exponent = aten.floor_divide.default(magnitude, 2)
    power = aten.pow.Scalar(
        2.0, aten.sub.Scalar(aten._to_copy.default(exponent, dtype=torch.float32), 1.0)
    )
    normal = aten.mul.Tensor(aten.add.Scalar(aten.mul.Scalar(mantissa, 0.5), 1.0), power)
    value = aten.where.self(aten.eq.Scalar(exponent, 0), aten.mul.Scalar(mantissa, 0.5), normal)
    return aten.where.self(aten.ge.Scalar(codes, 8), aten.neg.default(value), value)


def e8m0_powers(exponent: torch.Tensor) -> torch.Tensor:
    """fp32 `2^(byte - 127)` of e8m0 bytes (uint8), 255 included (as 2^128 = inf): no checks
    and no e8m0 dtype, so that a compiled forward can decode with it (Inductor's CPU code has
    no e8m0 type). The model's `quant.e8m0_values` checks a checkpoint's scales first."""
    ones = torch.ones(exponent.shape, device=exponent.device)
    return torch.ldexp(ones, exponent.int() - 127)
