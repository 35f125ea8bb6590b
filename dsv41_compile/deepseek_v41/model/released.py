"""The checkpoint's FP8 linears held as released (`ModelConfig.weight_format="released"`):
`Fp8Linear` keeps the e4m3 codes and their e8m0 block scales and decodes them when used;
`linear` builds one of the two forms, `weight_of` reads either's weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv41_compile.deepseek_v41.model.numerics import act_quant_dequant
from dsv41_compile.deepseek_v41.model.ops import fp8_weight
from dsv41_compile.deepseek_v41.model.quant import BLOCK, quantize_fp8

__all__ = ["Fp8Linear", "linear", "weight_of"]


class Fp8Linear(nn.Module):
    """A linear layer (no bias) whose weight is held as the checkpoint stores an FP8 weight
    (`ModelConfig.weight_format="released"`): `weight` float8_e4m3fn [out, in] and `scale`
    float8_e8m0fnu, one power of two per 32 x 32 block, decoded when used (`ops.fp8_weight`)
    to the values a "dequantized" model holds. `fp32`: computed in fp32, as `Fp32Linear`
    computes `wo_b`; `fp8_input`: the input FP8-quantised first, as `OutputProjection` does."""

    def __init__(
        self, in_features: int, out_features: int, *, fp32: bool = False, fp8_input: bool = False
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fp32, self.fp8_input = fp32, fp8_input
        blocks = (-(-out_features // BLOCK), -(-in_features // BLOCK))
        codes = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn)
        self.weight = nn.Parameter(codes, requires_grad=False)
        scale = torch.empty(blocks, dtype=torch.float8_e8m0fnu)
        self.scale = nn.Parameter(scale, requires_grad=False)

    def dense(self, dtype: torch.dtype) -> Tensor:
        """The weight decoded to `dtype`."""
        return fp8_weight(self.weight, self.scale, dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """A fan-in-scaled normal weight, quantised to FP8 (nothing on the meta device)."""
        if self.weight.is_meta:
            return
        values = torch.randn(self.out_features, self.in_features) * self.in_features**-0.5
        codes, scale = quantize_fp8(values)
        self.weight.copy_(codes)
        self.scale.copy_(scale)

    def forward(self, x: Tensor) -> Tensor:
        if self.fp8_input:
            x = act_quant_dequant(x)
        if self.fp32:
            return F.linear(x.float(), self.dense(torch.float32))
        return F.linear(x, self.dense(x.dtype))


def linear(
    in_features: int, out_features: int, *, released: bool, dtype: torch.dtype
) -> nn.Linear | Fp8Linear:
    """One of the checkpoint's FP8 linears: held as released (`Fp8Linear`) or in `dtype`."""
    if released:
        return Fp8Linear(in_features, out_features)
    return nn.Linear(in_features, out_features, bias=False, dtype=dtype)


def weight_of(layer: nn.Linear | Fp8Linear, dtype: torch.dtype) -> Tensor:
    """The weight of `layer` for a product in `dtype`: an `nn.Linear`'s as held, an
    `Fp8Linear`'s decoded to `dtype`."""
    return layer.dense(dtype) if isinstance(layer, Fp8Linear) else layer.weight
