"""The OCP microscaling (MX) element and scale formats the released weights and torch_npu's MX
ops share, decoded without a dtype of their own: e2m1 (4-bit floats, two per byte) and e8m0
(an exponent byte). Shared by the model (its FP4 experts, its FP8 block scales) and the CPU
stand-ins of torch_npu's MX ops; a leaf: it imports nothing of the package."""

from __future__ import annotations

import torch

__all__ = ["E2M1", "e2m1_values", "e8m0_powers"]

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit e2m1 code (bit 3 is the sign)."""

_E2M1_PAIRS = torch.tensor([[E2M1[b & 0xF], E2M1[b >> 4]] for b in range(256)])
"""Byte -> the values of its low and high nibble: one lookup decodes two inputs."""


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """The fp32 values of packed e2m1 pairs (int8 or uint8 `[..., n]`, element `2k` in the low
    nibble of byte k): `[..., 2n]`. Unscaled; no checks (the callers check their shapes)."""
    pairs = _E2M1_PAIRS.to(packed.device)[packed.view(torch.uint8).long()]
    return pairs.flatten(-2)


def e8m0_powers(exponent: torch.Tensor) -> torch.Tensor:
    """fp32 `2^(byte - 127)` of e8m0 bytes (uint8), 255 included (as 2^128 = inf): no checks
    and no e8m0 dtype, so that a compiled forward can decode with it (Inductor's CPU code has
    no e8m0 type). The model's `quant.e8m0_values` checks a checkpoint's scales first."""
    ones = torch.ones(exponent.shape, device=exponent.device)
    return torch.ldexp(ones, exponent.int() - 127)
