"""Building blocks shared by attention and MoE: RMSNorm, interleaved RoPE, delayed mHC.

Legend: T tokens, N mHC streams, D hidden, H heads, d head width, R rope width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv41_compile.deepseek_v41.model.config import ModelConfig


class StaticFloat(float):
    """A model constant that `torch.compile` keeps constant under `dynamic=True`.

    With `dynamic=True`, Dynamo makes every `float` attribute it reads a symbolic input, and
    AOTAutograd turns it into a tensor where it can. Where it cannot -- a float that reaches
    `clamp` or a custom op's `float` argument, as the SwiGLU limit does -- Dynamo traces the
    whole model a second time with it specialised; and in a compiled region (a decoder layer,
    `nested_compile_region`) AOTAutograd cannot trace its `.item()` at all. Dynamo treats an
    instance of a `float` subclass as a constant, guarded on its type and value (a changed value
    recompiles), so a float kept as this subclass costs one trace. Every float a layer reads is
    one (the norms' eps, mHC's eps, the router's scale, the SwiGLU limit)."""

    __slots__ = ()


class Embedding(nn.Embedding):
    """`nn.Embedding` whose forward reads no float attribute: V4.1 uses none of its options
    (`max_norm`, `norm_type`, ...), and Dynamo would make `norm_type` a symbolic input under
    `dynamic=True` (see `StaticFloat`). So it takes no option that its forward would ignore."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, device=None, dtype=None) -> None:
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)

    def forward(self, input: Tensor) -> Tensor:
        return F.embedding(input, self.weight)


class Fp32Linear(nn.Linear):
    """A linear layer computed in fp32 (input and weight upcast, fp32 out): the attention
    output projection `wo_b`, whose output the fp32 residual stream adds (a module of its own
    so that a layout can place what enters it: its input, in the activation dtype), and the
    head, whose fp32 weight gives fp32 logits as in the official inference code."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.float(), self.weight.float())


class RMSNorm(nn.Module):
    """`w * x / rms(x)`, computed in fp32 (weight stored fp32) and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = StaticFloat(eps)
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: Tensor) -> Tensor:
        x_f = x.float()
        x_f = x_f * torch.rsqrt(x_f.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * x_f).to(x.dtype)


def rope_inv_freq(rope_dim: int, base: float) -> Tensor:
    """Inverse frequencies `base^(-2i/R)` of the R/2 rotated pairs (fp32)."""
    return 1.0 / base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)


def yarn_inv_freq(
    rope_dim: int,
    base: float,
    *,
    factor: float,
    original_max_pos: int,
    beta_fast: float,
    beta_slow: float,
) -> Tensor:
    """YaRN-scaled inverse frequencies (DeepSeek's `precompute_freqs_cis` with
    `original_seq_len > 0`): pairs rotating fewer than `beta_slow` times over the original
    context are divided by `factor`, pairs rotating more than `beta_fast` times are kept, with a
    linear ramp between. No attention-temperature (mscale) term."""
    inv_freq = rope_inv_freq(rope_dim, base)

    def correction_dim(rotations: float) -> float:
        return (
            rope_dim * math.log(original_max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))
        )

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp
    return inv_freq / factor * (1 - smooth) + inv_freq * smooth


def apply_rope(
    x: Tensor, positions_T: Tensor, inv_freq: Tensor, *, inverse: bool = False
) -> Tensor:
    """Rotate the last R = 2*len(inv_freq) dims of `x` ([T, ..., d]) by `positions_T`.

    Pairs are interleaved: (x0, x1), (x2, x3), ... are the complex numbers, as in the reference
    `view_as_complex(x.unflatten(-1, (-1, 2)))`. `inverse` rotates by -angle (used to de-rotate
    the attention output with the query position). Computed in fp32, cast back.
    """
    rope_dim = 2 * inv_freq.numel()
    angles_TP = positions_T.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = angles_TP.view(angles_TP.shape[0], *([1] * (x.dim() - 2)), angles_TP.shape[1])
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    re, im = x[..., -rope_dim:].float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rope_dim], rotated.to(x.dtype)), dim=-1)


class HyperConnection(nn.Module):
    """mHC coefficients of one sublayer site (attention or FFN), from the (2+N)*N-way projection.

    `forward(x_TND)` returns `pre_TN` in (0, 1+eps], `post_TN` in (0, 2) and the comb matrices
    `comb_TNN`, Sinkhorn-normalised to (approximately) doubly stochastic. All fp32.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n = cfg.hc_mult
        self.iters = cfg.hc_sinkhorn_iters
        self.hc_eps = StaticFloat(cfg.hc_eps)
        self.norm_eps = StaticFloat(cfg.rms_norm_eps)
        self.fn = nn.Parameter(torch.empty(cfg.hc_mix_dim, cfg.hc_mult * cfg.dim))
        self.base = nn.Parameter(torch.empty(cfg.hc_mix_dim))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, x_TND: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        n, eps = self.n, self.hc_eps
        x_TF = x_TND.flatten(1).float()
        # The RMS of the flattened streams is applied after the projection ("reordered norm").
        mix_TM = F.linear(x_TF, self.fn) * torch.rsqrt(
            x_TF.square().mean(-1, keepdim=True) + self.norm_eps
        )
        pre_TN = torch.sigmoid(mix_TM[:, :n] * self.scale[0] + self.base[:n]) + eps
        post_TN = 2 * torch.sigmoid(mix_TM[:, n : 2 * n] * self.scale[1] + self.base[n : 2 * n])
        comb_logits = mix_TM[:, 2 * n :] * self.scale[2] + self.base[2 * n :]
        comb_TNN = torch.softmax(comb_logits.unflatten(-1, (n, n)), dim=-1) + eps
        comb_TNN = comb_TNN / (comb_TNN.sum(-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):
            comb_TNN = comb_TNN / (comb_TNN.sum(-1, keepdim=True) + eps)
            comb_TNN = comb_TNN / (comb_TNN.sum(-2, keepdim=True) + eps)
        return pre_TN, post_TN, comb_TNN


def hc_collapse(x_TND: Tensor, pre_TN: Tensor) -> Tensor:
    """`y[t] = sum_i pre[t, i] * X[t, i]` in fp32, cast to the stream dtype: [T, D]."""
    return (pre_TN[:, :, None] * x_TND.float()).sum(1).to(x_TND.dtype)


def hc_expand(x_TND: Tensor, f_TD: Tensor, post_TN: Tensor, comb_TNN: Tensor) -> Tensor:
    """`X'[t, j] = post[t, j] * f[t] + sum_i C[t, i, j] * X[t, i]` (i.e. post (x) f + C^T X)."""
    mixed_TND = torch.einsum("tij,tid->tjd", comb_TNN, x_TND.float())
    return (post_TN[:, :, None] * f_TD.float()[:, None, :] + mixed_TND).to(x_TND.dtype)
