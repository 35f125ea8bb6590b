"""V4.1 MoE: sqrt-softplus gate with a selection-only bias, routed experts (one custom op),
one shared expert.

Legend: T tokens, D hidden, E routed experts, K top-k, I expert intermediate width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv41_compile.deepseek_v41.model.config import ModelConfig
from dsv41_compile.deepseek_v41.model.layers import StaticFloat
from dsv41_compile.deepseek_v41.model.numerics import act_quant_dequant
from dsv41_compile.deepseek_v41.model.ops import routed_experts, routed_experts_fp4, swiglu_expert
from dsv41_compile.deepseek_v41.model.quant import BLOCK, quantize_fp4
from dsv41_compile.deepseek_v41.model.released import linear, weight_of


class Gate(nn.Module):
    """Router (fp32): `s = sqrt(softplus(x Wg^T))`; experts = top-k of `s + bias`; weights =
    the picked `s` normalised to sum 1, times `routed_scaling_factor`. The bias (aux-loss-free
    balancing) changes which experts are picked, never the weights' formula."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.topk = cfg.n_activated_experts
        self.route_scale = StaticFloat(cfg.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x_TD: Tensor, valid_T: Tensor) -> tuple[Tensor, Tensor]:
        """Returns `topk_idx [T, K]` (int64, -1 on invalid rows) and `topk_weight [T, K]` fp32."""
        scores_TE = torch.sqrt(F.softplus(F.linear(x_TD.float(), self.weight)))
        topk_idx_TK = torch.topk(scores_TE + self.bias, self.topk, dim=-1).indices
        topk_weight_TK = scores_TE.gather(1, topk_idx_TK)
        topk_weight_TK = topk_weight_TK / (topk_weight_TK.sum(-1, keepdim=True) + 1e-20)
        topk_weight_TK = topk_weight_TK * self.route_scale
        # Padding rows are routed nowhere: no assignment reaches any expert.
        topk_idx_TK = torch.where(valid_T[:, None], topk_idx_TK, -1)
        topk_weight_TK = torch.where(valid_T[:, None], topk_weight_TK, 0.0)
        return topk_idx_TK, topk_weight_TK


class RoutedExperts(nn.Module):
    """The E routed experts' weights, stacked on a leading expert dim (the EP shard dim).

    `weight_format="released"` holds each as the checkpoint stores it: `w1` int8 [E, I, D/2]
    (e2m1 codes, two per byte) and `w1_scale` float8_e8m0fnu [E, I, D/32], likewise `w2`,
    `w3`; the op decodes an expert's weights when it has rows (`ops.routed_experts_fp4`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, I, D, dtype = cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim, cfg.torch_dtype
        self.swiglu_limit = StaticFloat(cfg.swiglu_limit)
        self.fp8_hidden = cfg.rounding.expert_hidden
        self.released = cfg.weight_format == "released"
        shapes = {"w1": (E, I, D), "w2": (E, D, I), "w3": (E, I, D)}
        for name, (e, rows, inputs) in shapes.items():
            if self.released:
                codes = torch.empty(e, rows, inputs // 2, dtype=torch.int8)
                scale = torch.empty(e, rows, inputs // BLOCK, dtype=torch.float8_e8m0fnu)
                setattr(self, name, nn.Parameter(codes, requires_grad=False))
                setattr(self, f"{name}_scale", nn.Parameter(scale, requires_grad=False))
            else:
                setattr(self, name, nn.Parameter(torch.empty(e, rows, inputs, dtype=dtype)))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Fan-in-scaled normals (in the released format: quantised to FP4, row by row)."""
        for name in ("w1", "w3", "w2"):
            w = getattr(self, name)
            if not self.released:
                nn.init.normal_(w, std=w.shape[-1] ** -0.5)
                continue
            if w.is_meta:  # a model built for its shapes: nothing to quantise
                continue
            inputs = 2 * w.shape[-1]
            values = torch.randn(*w.shape[:-1], inputs) * inputs**-0.5
            codes, scale = quantize_fp4(values.flatten(0, 1))
            w.copy_(codes.view(w.shape))
            getattr(self, f"{name}_scale").copy_(scale.view(w.shape[0], w.shape[1], -1))

    def forward(self, x_TD: Tensor, topk_idx_TK: Tensor, topk_weight_TK: Tensor) -> Tensor:
        # A constant at its default is left out of a traced call: bf16 graphs are unchanged.
        if self.released:
            return routed_experts_fp4(
                x_TD,
                topk_idx_TK,
                topk_weight_TK,
                self.w1,
                self.w1_scale,
                self.w2,
                self.w2_scale,
                self.w3,
                self.w3_scale,
                self.swiglu_limit,
                self.fp8_hidden,
            )
        return routed_experts(
            x_TD,
            topk_idx_TK,
            topk_weight_TK,
            self.w1,
            self.w2,
            self.w3,
            self.swiglu_limit,
            self.fp8_hidden,
        )


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, I, dtype = cfg.dim, cfg.moe_inter_dim, cfg.torch_dtype
        self.swiglu_limit = StaticFloat(cfg.swiglu_limit)
        self.fp8_hidden = cfg.rounding.expert_hidden
        released = cfg.weight_format == "released"
        self.w1 = linear(D, I, released=released, dtype=dtype)
        self.w2 = linear(I, D, released=released, dtype=dtype)
        self.w3 = linear(D, I, released=released, dtype=dtype)

    def forward(self, x_TD: Tensor) -> Tensor:
        dtype = x_TD.dtype
        return swiglu_expert(
            x_TD,
            weight_of(self.w1, dtype),
            weight_of(self.w2, dtype),
            weight_of(self.w3, dtype),
            self.swiglu_limit,
            fp8_hidden=self.fp8_hidden,
        )


class MoE(nn.Module):
    """Router, routed experts and shared expert. Official numerics (`config.Rounding`): the
    experts' input is FP8-quantised once, before the routed-experts op (so that dispatch can
    move its FP8 codes), for the routed and the shared experts alike, and not for the router;
    the hidden activation before `w2`, inside the op."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fp8_inputs = cfg.rounding.expert_inputs
        self.gate = Gate(cfg)
        self.experts = RoutedExperts(cfg)
        self.shared_expert = SharedExpert(cfg)

    def forward(self, x_TD: Tensor, valid_T: Tensor) -> Tensor:
        topk_idx_TK, topk_weight_TK = self.gate(x_TD, valid_T)
        experts_x_TD = act_quant_dequant(x_TD) if self.fp8_inputs else x_TD
        routed_TD = self.experts(experts_x_TD, topk_idx_TK, topk_weight_TK)  # fp32 accumulation
        return (routed_TD + self.shared_expert(experts_x_TD).float()).to(x_TD.dtype)
