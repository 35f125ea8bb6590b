"""Edits of the single-device model, as a researcher makes them on a new architecture: each
changes one thing in the model's source -- a new module or parameter, another activation or
normalisation, an op on a partial sum, an op along the token, head or expert dim -- and is
applied to a model instance, so that a test (or a user's own check) compiles the edited model
and compares it with the same edited model on one device.

    model = DeepseekV41(cfg)
    EDITS["token_shift_cat"].apply(model)             # every decoder layer
    EDITS["capped_head"].apply(model)                 # edits of other modules combine
    EDITS["ffn_layernorm"].apply(model, layers=[1])   # or only some layers
    reference = copy.deepcopy(model)                  # after the edits

An edit replaces a module's `forward` (its class becomes a subclass with the edited method, as
if the source had been edited; the subclass is made once per class and edit) and adds its new
parameters with values drawn from a generator seeded by the edit's name and the layer: every
rank, and the reference copied after `apply`, hold the same ones. Edits of different modules
combine; two edits of one module raise a `ValueError`. The edits that mix tokens work on a
decoder layer's attention input or its FFN input, where the tokens are sharded, through a copy
of `Block.forward` (a compiled region like the original) that hands the input to the edit with
the request of each token (`cache_slot_T`) and `valid_T`; a layer takes one at each.

Legend: T tokens, D hidden, H heads, d head width, E routed experts, K top-k.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv41_compile.deepseek_v41.model import DeepseekV41
from dsv41_compile.deepseek_v41.model.block import _LAYER_KINDS, Block
from dsv41_compile.deepseek_v41.model.cache import LayerCache
from dsv41_compile.deepseek_v41.model.layers import hc_collapse, hc_expand

__all__ = ["EDITS", "Edit"]

Patch = Callable[[DeepseekV41, Sequence[Block], torch.Generator], None]


@dataclass(frozen=True)
class Edit:
    """One edit of the model's source: `apply(model)` makes it on an instance."""

    name: str
    what: str
    """The edit in a researcher's words."""
    patch: Patch
    """Makes the edit on the given decoder layers (an edit of the head ignores them)."""
    options: tuple[tuple[str, Any], ...] = ()
    """Backend options the edit is compiled with besides tp (e.g. the attention exit whose
    partial sum it reads)."""
    mixes_tokens: bool = False
    """Whether the edit mixes the rows of different tokens (a statistic, a shift, a scan)."""
    in_layers: bool = True
    """Whether the edit is made in decoder layers (else in the modules around them)."""
    dynamo_config: tuple[tuple[str, Any], ...] = ()
    """Dynamo settings a user sets to trace the edit (`torch._dynamo.config`): an op whose
    output size its input's values decide (`nonzero`, `masked_select`, `bincount`, `x[mask]`)
    inside a decoder layer, a compiled region, needs `capture_dynamic_output_shape_ops`."""

    def apply(self, model: DeepseekV41, layers: Sequence[int] | None = None) -> DeepseekV41:
        """Make the edit on `model`, in the decoder layers `layers` (all by default)."""
        chosen = [
            cast(Block, model.layers[i])
            for i in (range(len(model.layers)) if layers is None else layers)
        ]
        seed = sum(map(ord, self.name)) * 1000 + (min(layers) if layers else 0)
        self.patch(model, chosen, torch.Generator().manual_seed(seed))
        return model


_SUBCLASSES: dict[tuple[type, Callable[..., Any]], type] = {}


def _edit_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    """`module`'s class becomes a subclass whose `forward` is `forward` (one per class and
    edit: the layers of a model share it). A module edited already is not edited again: two
    edits of one `forward` do not combine."""
    cls = type(module)
    if cls in _SUBCLASSES.values():
        raise ValueError(
            f"{cls.__name__}.forward of this module was edited already: one edit per module"
        )
    key = (cls, forward)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(cls.__name__, (cls,), {"forward": forward})
    module.__class__ = _SUBCLASSES[key]


def _original(self: nn.Module) -> type:
    """The class an edited module had before the edit."""
    return type(self).__bases__[0]


def _parameter(generator: torch.Generator, *shape: int, std: float = 0.1, mean: float = 0.0):
    """A new parameter, drawn from the edit's generator (no grad: dsv41_sp compiles inference)."""
    value = torch.randn(shape, generator=generator) * std + mean
    return nn.Parameter(value, requires_grad=False)


# -- New modules and parameters, other activations and norms: per-token edits ----------------


def _attn_output_gate(model: DeepseekV41, layers: Sequence[Block], generator) -> None:
    """A sigmoid gate on attention's output, from the attention input (gated attention)."""
    dim = model.cfg.dim
    for layer in layers:
        gate = nn.Linear(dim, dim, bias=False)
        gate.weight = _parameter(generator, dim, dim, std=dim**-0.5)
        layer.attn.add_module("gate", gate)
        _edit_forward(layer.attn, _gated_attention)


def _gated_attention(self, x_TD, *args, **kwargs):
    out_TD, made = _original(self).forward(self, x_TD, *args, **kwargs)
    return out_TD * torch.sigmoid(self.gate(x_TD).float()), made


def _q_head_scale(model: DeepseekV41, layers: Sequence[Block], generator) -> None:
    """A learned scale per query head (the head dim is sharded over tp)."""
    for layer in layers:
        wq_b = layer.attn.wq_b
        wq_b.head_scale = _parameter(generator, model.cfg.n_heads, mean=1.0)
        _edit_forward(wq_b, _scaled_heads)


def _scaled_heads(self, q_TQ):
    q_THd = F.linear(q_TQ, self.weight).unflatten(-1, (self.head_scale.shape[0], -1))
    return (q_THd * self.head_scale[:, None]).flatten(1)


def _q_head_softmax(model: DeepseekV41, layers: Sequence[Block], generator) -> None:
    """The query heads reweighted by a softmax across the heads of a learned probe of each
    head's query: an op along the head dim, which tp shards."""
    for layer in layers:
        wq_b = layer.attn.wq_b
        wq_b.head_probe = _parameter(generator, model.cfg.head_dim, std=0.2)
        _edit_forward(wq_b, _softmax_heads)


def _softmax_heads(self, q_TQ):
    q_THd = F.linear(q_TQ, self.weight).unflatten(-1, (-1, self.head_probe.shape[0]))
    weight_TH = torch.softmax((q_THd * self.head_probe).sum(-1), dim=-1) * q_THd.shape[1]
    return (q_THd * weight_TH[..., None]).flatten(1)


def _wo_b_bias(model: DeepseekV41, layers: Sequence[Block], generator) -> None:
    """A bias on the attention output projection `wo_b`, which is row-parallel: its output is
    a partial sum over tp (`attn_exit="reduce_scatter"`)."""
    for layer in layers:
        wo_b = layer.attn.wo_b
        wo_b.bias = _parameter(generator, wo_b.out_features)
        _edit_forward(wo_b, _biased_fp32_linear)


def _biased_fp32_linear(self, x):
    return F.linear(x.float(), self.weight.float(), self.bias.float())


def _attn_out_norm(model: DeepseekV41, layers: Sequence[Block], generator) -> None:
    """An RMSNorm of attention's output before the residual (a sandwich norm): of `wo_b`'s
    partial sum (`attn_exit="reduce_scatter"`)."""
    dim = model.cfg.dim
    for layer in layers:
        layer.attn.out_norm = nn.RMSNorm(dim, eps=1e-6)
        layer.attn.out_norm.weight = _parameter(generator, dim, mean=1.0)
        _edit_forward(layer.attn, _normed_attention)


def _normed_attention(self, x_TD, *args, **kwargs):
    out_TD, made = _original(self).forward(self, x_TD, *args, **kwargs)
    return self.out_norm(out_TD), made


def _router_softmax_topk(model: DeepseekV41, layers: Sequence[Block], generator) -> None:
    """DeepSeek-V2's router: softmax over the experts, top-k of the probabilities, no
    selection bias, weights renormalised."""
    for layer in layers:
        _edit_forward(layer.ffn.gate, _softmax_router)


def _softmax_router(self, x_TD, valid_T):
    probs_TE = torch.softmax(F.linear(x_TD.float(), self.weight), dim=-1)
    weight_TK, idx_TK = torch.topk(probs_TE, self.topk, dim=-1)
    weight_TK = weight_TK / weight_TK.sum(-1, keepdim=True) * self.route_scale
    return torch.where(valid_T[:, None], idx_TK, -1), torch.where(valid_T[:, None], weight_TK, 0.0)


def _shared_expert_gelu(model: DeepseekV41, layers: Sequence[Block], generator) -> None:
    """GELU instead of SiLU in the shared expert's gated unit (GeGLU)."""
    for layer in layers:
        _edit_forward(layer.ffn.shared_expert, _geglu)


def _geglu(self, x_TD):
    return self.w2(F.gelu(self.w1(x_TD)) * self.w3(x_TD))


def _shared_expert_gate(model: DeepseekV41, layers: Sequence[Block], generator) -> None:
    """Qwen2-MoE's shared-expert gate: the shared expert's output scaled by a sigmoid of a
    new one-output Linear of the FFN input."""
    dim = model.cfg.dim
    for layer in layers:
        gate = nn.Linear(dim, 1, bias=False)
        gate.weight = _parameter(generator, 1, dim, std=dim**-0.5)
        layer.ffn.add_module("shared_gate", gate)
        _edit_forward(layer.ffn, _gated_shared_moe)


def _gated_shared_moe(self, x_TD, valid_T):
    topk_idx_TK, topk_weight_TK = self.gate(x_TD, valid_T)
    routed_TD = self.experts(x_TD, topk_idx_TK, topk_weight_TK)
    shared_TD = self.shared_expert(x_TD).float() * torch.sigmoid(self.shared_gate(x_TD).float())
    return (routed_TD + shared_TD).to(x_TD.dtype)


def _ffn_layernorm(model: DeepseekV41, layers: Sequence[Block], generator) -> None:
    """LayerNorm (with a bias) instead of RMSNorm before the FFN."""
    dim = model.cfg.dim
    for layer in layers:
        norm = nn.LayerNorm(dim, eps=1e-6)
        norm.weight = _parameter(generator, dim, mean=1.0)
        norm.bias = _parameter(generator, dim)
        layer.ffn_norm = norm


def _hc_post_scale(model: DeepseekV41, layers: Sequence[Block], generator) -> None:
    """A learned scale per mHC stream on the sublayer output's weights (`post`)."""
    n = model.cfg.hc_mult
    for layer in layers:
        for hc in (layer.hc_attn, layer.hc_ffn):
            hc.post_scale = _parameter(generator, n, mean=1.0)
            _edit_forward(hc, _scaled_post)


def _scaled_post(self, x_TND):
    pre_TN, post_TN, comb_TNN = _original(self).forward(self, x_TND)
    return pre_TN, post_TN * self.post_scale, comb_TNN


def _capped_head(model: DeepseekV41, layers: Sequence[Block], generator) -> None:
    """Soft-capped logits: `cap * tanh(logits / cap)` (Gemma 2)."""
    _edit_forward(model.head, _soft_capped)


def _soft_capped(self, y_TD):
    cap = 5.0
    return cap * torch.tanh(F.linear(y_TD, self.weight) / cap)


# -- Ops along the token dim: a layer's attention or FFN input, where tokens are sharded ----


_SITES = ("attention", "ffn")
"""Where a layer's edits that mix tokens work: the attention input or the FFN input, both
token-sharded (before attention's entry gather, after the attention's exit)."""

_MIXED: dict[tuple[Callable[..., Tensor] | None, ...], type] = {}


def _mixed_forward(attn_mix: Callable | None, ffn_mix: Callable | None) -> Callable[..., Any]:
    """`Block.forward` with `attn_in_TD = attn_mix(self, attn_in_TD, cache_slot_T, valid_T)`
    and the same of `ffn_in_TD` (where given; a mix with a `num_slots` parameter also gets the
    cache's slot count: `cache_slot_T` runs over `0 .. num_slots`, the last the scratch slot of
    padding rows); a compiled region like the original (a layer kind traced once)."""
    attn_slots, ffn_slots = (
        mix is not None and "num_slots" in inspect.signature(mix).parameters
        for mix in (attn_mix, ffn_mix)
    )

    @torch.compiler.nested_compile_region(max_reuse_entries=_LAYER_KINDS)
    def forward(
        self, x_TND, pre_TN, positions_T, cache_slot_T, valid_T, num_slots, lengths, window,
        compressed, index_k, pair_state, idx_TK, picked_TK, candidates_TC, engram_rows_TC,
    ):  # fmt: skip
        kv = LayerCache(num_slots, lengths, window, compressed, index_k, pair_state)
        topk = None if idx_TK is None or picked_TK is None else (idx_TK, picked_TK)
        if engram_rows_TC is not None:
            x_TND = self.engram(x_TND, engram_rows_TC)
        attn_pre_TN, attn_post_TN, attn_comb_TNN = self.hc_attn(x_TND)
        attn_in_TD = self.attn_norm(hc_collapse(x_TND, pre_TN))
        if attn_mix is not None:
            slots = {"num_slots": num_slots} if attn_slots else {}
            attn_in_TD = attn_mix(self, attn_in_TD, cache_slot_T, valid_T, **slots)
        attn_out_TD, made = self.attn(
            attn_in_TD, positions_T, cache_slot_T, kv, topk, candidates_TC
        )
        x_TND = hc_expand(x_TND, attn_out_TD, attn_post_TN, attn_comb_TNN)
        ffn_pre_TN, ffn_post_TN, ffn_comb_TNN = self.hc_ffn(x_TND)
        ffn_in_TD = self.ffn_norm(hc_collapse(x_TND, attn_pre_TN))
        if ffn_mix is not None:
            slots = {"num_slots": num_slots} if ffn_slots else {}
            ffn_in_TD = ffn_mix(self, ffn_in_TD, cache_slot_T, valid_T, **slots)
        ffn_out_TD = self.ffn(ffn_in_TD, valid_T)
        x_TND = hc_expand(x_TND, ffn_out_TD, ffn_post_TN, ffn_comb_TNN)
        return (x_TND, ffn_pre_TN, *made)

    return forward


def _mixing(site: str, mix: Callable[..., Tensor], **params: tuple[int | str, ...]) -> Patch:
    """An edit that mixes the tokens of a layer's input to `site` (`_SITES`) with `mix`,
    adding `params` (name -> shape, "D" the hidden size; drawn around 0.5) to the layer. A
    layer takes one such edit per site: its class becomes a subclass of `Block` whose
    `forward` mixes at each site taken (one per combination of mixes)."""
    assert site in _SITES, site

    def patch(model: DeepseekV41, layers: Sequence[Block], generator) -> None:
        for layer in layers:
            mixes = dict(getattr(layer, "token_mixes", {}))
            if site in mixes:
                raise ValueError(
                    f"the {site} input of layer {layer.layer_id} mixes tokens already: one edit "
                    "that mixes tokens per site"
                )
            mixes[site] = mix
            for name, shape in params.items():
                assert not hasattr(layer, name), name  # each edit's parameters its own
                sizes = [model.cfg.dim if s == "D" else cast(int, s) for s in shape]
                setattr(layer, name, _parameter(generator, *sizes, std=0.2, mean=0.5))
            key = tuple(mixes.get(s) for s in _SITES)
            if key not in _MIXED:
                _MIXED[key] = type("Block", (Block,), {"forward": _mixed_forward(*key)})
            layer.__class__ = _MIXED[key]
            # nn.Module.__setattr__ stores any value; torch types it Tensor | Module
            layer.token_mixes = mixes  # type: ignore[assignment]

    return patch


def _same_request_as_previous(cache_slot_T: Tensor) -> Tensor:
    """Whether row t - 1 holds the same request as row t (a request's rows are contiguous)."""
    first = torch.zeros_like(cache_slot_T[:1], dtype=torch.bool)
    return torch.cat([first, cache_slot_T[1:] == cache_slot_T[:-1]])


def _batch_centering(self, x_TD, cache_slot_T, valid_T):
    """The input minus its mean over the batch's valid tokens (a batch statistic)."""
    w_T1 = valid_T[:, None].to(x_TD.dtype)
    mean_D = (x_TD * w_T1).sum(0) / w_T1.sum(0).clamp(min=1)
    return x_TD - self.centering * mean_D


def _batch_scale(self, x_TD, cache_slot_T, valid_T):
    """The input scaled per channel by batch statistics: its largest magnitude over the
    valid tokens, and its mean square over the batch's rows."""
    amax_D = torch.where(valid_T[:, None], x_TD.abs(), 0.0).amax(0)
    ms_D = x_TD.square().mean(0)
    return x_TD * torch.rsqrt(ms_D + 1) / (1 + self.amax_weight * amax_D)


def _token_shift_cat(self, x_TD, cache_slot_T, valid_T):
    """RWKV's token shift within a request: x[t] mixed with x[t-1], written with slices."""
    prev_TD = torch.cat([x_TD.new_zeros(1, x_TD.shape[1]), x_TD[:-1]])
    prev_TD = torch.where(_same_request_as_previous(cache_slot_T)[:, None], prev_TD, 0.0)
    return x_TD + self.shift_mix * (prev_TD - x_TD)


def _token_shift_roll(self, x_TD, cache_slot_T, valid_T):
    """The same token shift written with torch.roll (row 0 gets the last row, masked)."""
    prev_TD = torch.roll(x_TD, 1, 0)
    first_T = torch.arange(x_TD.shape[0], device=x_TD.device) == 0
    same_T = (torch.roll(cache_slot_T, 1, 0) == cache_slot_T) & ~first_T
    return x_TD + self.roll_mix * (torch.where(same_T[:, None], prev_TD, 0.0) - x_TD)


def _token_diff(self, x_TD, cache_slot_T, valid_T):
    """The difference from the previous token, written with torch.diff (the first row's
    difference from itself: 0), masked at request boundaries."""
    delta_TD = torch.diff(x_TD, dim=0, prepend=x_TD[:1])
    same_T1 = _same_request_as_previous(cache_slot_T)[:, None]
    return x_TD + self.diff_mix * torch.where(same_T1, delta_TD, 0.0)


def _causal_conv(self, x_TD, cache_slot_T, valid_T):
    """A short causal depthwise convolution over the request's last 3 tokens (Mamba's,
    per request), as padded shifts: y[t] = sum_j w[j] * x[t - j] within the request."""
    T = x_TD.shape[0]
    y_TD = self.conv_weight[0] * x_TD
    same_T = torch.ones_like(cache_slot_T, dtype=torch.bool)
    for j in range(1, self.conv_weight.shape[0]):
        shifted_T = F.pad(cache_slot_T, (j, 0), value=-2)[:T]
        same_T = same_T & (shifted_T == cache_slot_T)
        y_TD = y_TD + self.conv_weight[j] * torch.where(
            same_T[:, None], F.pad(x_TD, (0, 0, j, 0))[:T], 0
        )
    return y_TD


def _conv1d_over_batch(self, x_TD, cache_slot_T, valid_T):
    """A causal depthwise `F.conv1d` over the whole batch (tokens as the sequence dim)."""
    width = self.conv1d_weight.shape[0]
    x_1DT = x_TD.t().unsqueeze(0)
    weight_D1W = self.conv1d_weight.flip(0)[None, None, :].expand(x_TD.shape[1], 1, width)
    y_1DT = F.conv1d(F.pad(x_1DT, (width - 1, 0)), weight_D1W, groups=x_TD.shape[1])
    return y_1DT[0].t()


def _request_running_mean(self, x_TD, cache_slot_T, valid_T):
    """Each token's input plus the mean of its request's inputs up to it: a cumulative sum
    over the batch, minus its value before the request's first token."""
    T = x_TD.shape[0]
    csum_TD = torch.cumsum(x_TD, 0)
    rows_T = torch.arange(T, device=x_TD.device)
    starts_T = torch.where(~_same_request_as_previous(cache_slot_T), rows_T, 0)
    first_T = torch.cummax(starts_T, 0).values
    before_TD = (csum_TD - x_TD)[first_T]
    count_T1 = (rows_T - first_T + 1)[:, None].to(x_TD.dtype)
    return x_TD + self.running_mean_weight * (csum_TD - before_TD) / count_T1


def _request_mean_index_add(self, x_TD, cache_slot_T, valid_T, num_slots):
    """Each token's input plus the mean of its request's valid inputs in this call, written
    with `index_add` over the cache's slots: sums per slot divided by the counts per slot,
    read back at each token's slot."""
    w_T1 = valid_T[:, None].to(x_TD.dtype)
    zeros_SD = x_TD.new_zeros(num_slots + 1, x_TD.shape[1])
    sums_SD = zeros_SD.index_add(0, cache_slot_T, x_TD * w_T1)
    counts_S = x_TD.new_zeros(num_slots + 1).index_add(0, cache_slot_T, w_T1[:, 0])
    mean_SD = sums_SD / counts_S.clamp(min=1)[:, None]
    return x_TD + self.request_mean_weight * mean_SD[cache_slot_T]


def _request_max_scatter_reduce(self, x_TD, cache_slot_T, valid_T, num_slots):
    """Each token's input plus its request's largest input per channel in this call,
    written with `scatter_reduce(..., "amax")` over the cache's slots."""
    valid_T1 = valid_T[:, None]
    rows_TD = torch.where(valid_T1, x_TD, float("-inf"))
    lowest_SD = x_TD.new_full((num_slots + 1, x_TD.shape[1]), float("-inf"))
    max_SD = lowest_SD.scatter_reduce(0, cache_slot_T[:, None].expand_as(x_TD), rows_TD, "amax")
    return x_TD + self.request_max_weight * torch.where(valid_T1, max_SD[cache_slot_T], 0.0)


def _request_mean_scatter_reduce(self, x_TD, cache_slot_T, valid_T, num_slots):
    """The same request mean written with `scatter_reduce(..., "mean", include_self=False)`
    (the padding rows' scratch slot included: only real requests' rows are read back)."""
    index_TD = cache_slot_T[:, None].expand_as(x_TD)
    zeros_SD = x_TD.new_zeros(num_slots + 1, x_TD.shape[1])
    mean_SD = zeros_SD.scatter_reduce(0, index_TD, x_TD, "mean", include_self=False)
    return x_TD + self.scatter_mean_weight * torch.where(
        valid_T[:, None], mean_SD[cache_slot_T], 0.0
    )


def _top_token_boost(self, x_TD, cache_slot_T, valid_T):
    """The valid token whose input has the largest first channel, scaled up, the last token
    nudged towards it and the first away from it: writes (`x[i] = v`, `index_put`,
    `index_copy`) and reads at computed token indices (tensor indices, not numbers read on
    the host)."""
    score_T = torch.where(valid_T, x_TD[:, 0], float("-inf"))
    top_1 = score_T.argmax(0, keepdim=True)
    x_TD = x_TD.clone()
    x_TD[top_1] = x_TD[top_1] * (1 + self.top_boost)
    last_1 = torch.full_like(top_1, -1)  # the last row: a negative index, from the end
    x_TD = x_TD.index_put((last_1,), x_TD[last_1] + self.top_boost * x_TD[top_1])
    first_1 = torch.zeros_like(top_1)  # and the first, with index_copy
    return x_TD.index_copy(0, first_1, x_TD[first_1] - self.top_boost * x_TD[top_1])


def _probe_scores(probe_D, x_TD, valid_T):
    """Each valid token's score, a learned probe of its input (padding rows: -inf). A score
    that tells tokens apart: the L2 norm of a normed input would not -- RMSNorm with unit
    weights makes every row's norm sqrt(D) up to rounding, and a selection among such ties is
    decided by the last bits, which any other summation order changes (README, "Selections by
    value")."""
    return (x_TD.float() @ probe_D).masked_fill(~valid_T, float("-inf"))


def _valid_rows(x_TD, valid_T, index):
    """The rows of `x_TD` at `index` and their weights, 1 for a valid token, 0 for padding."""
    return x_TD[index], valid_T[index][:, None].to(x_TD.dtype)


def _top_tokens_mean(self, x_TD, cache_slot_T, valid_T):
    """The mean of the (at most) two valid tokens of highest score, a fraction of it added to
    every valid token: tokens selected by value (`topk` over the tokens, `k = min(2, T)`) and
    read at the computed indices (`x[top_K]`)."""
    top_K = torch.topk(
        _probe_scores(self.top_probe, x_TD, valid_T), min(2, x_TD.shape[0]), dim=0
    ).indices
    rows_KD, weight_K1 = _valid_rows(x_TD, valid_T, top_K)
    mean_D = (rows_KD * weight_K1).sum(0) / weight_K1.sum().clamp(min=1)
    return x_TD + self.top_weight * mean_D * valid_T[:, None].to(x_TD.dtype)


def _top_token_row(self, x_TD, cache_slot_T, valid_T):
    """The valid token of highest score added, scaled, to every valid token: the index a
    tensor (`argmax(0, keepdim=True)`), the row read at it (`x[top_1]`)."""
    top_1 = _probe_scores(self.row_probe, x_TD, valid_T).argmax(0, keepdim=True)
    rows_1D, weight_11 = _valid_rows(x_TD, valid_T, top_1)
    return x_TD + self.row_weight * (rows_1D * weight_11) * valid_T[:, None].to(x_TD.dtype)


def _sorted_tokens_blend(self, x_TD, cache_slot_T, valid_T):
    """The (at most) three valid tokens of highest score, blended by a softmax of their
    scores, added to every valid token: tokens ranked by `argsort` (a sort along the tokens),
    the first three read with `index_select`."""
    score_T = _probe_scores(self.blend_probe, x_TD, valid_T)
    order_T = torch.argsort(score_T, dim=0, descending=True)
    top_K = order_T[: min(3, x_TD.shape[0])]
    weight_K = torch.softmax(score_T.index_select(0, top_K).clamp(min=-1e4), dim=0)
    weight_K1 = (weight_K * valid_T.index_select(0, top_K))[:, None].to(x_TD.dtype)
    blend_D = (x_TD.index_select(0, top_K) * weight_K1).sum(0)
    return x_TD + self.blend_weight * blend_D * valid_T[:, None].to(x_TD.dtype)


def _max_token_gather(self, x_TD, cache_slot_T, valid_T):
    """The valid token of highest score, by `max(dim=0)`'s indices, read with `gather` and
    added, scaled, to every valid token."""
    top_1 = _probe_scores(self.max_probe, x_TD, valid_T).max(dim=0, keepdim=True).indices
    row_1D = torch.gather(x_TD, 0, top_1[:, None].expand(-1, x_TD.shape[1]))
    weight_11 = valid_T.gather(0, top_1)[:, None].to(x_TD.dtype)
    return x_TD + self.max_weight * row_1D * weight_11 * valid_T[:, None].to(x_TD.dtype)


def _masked_token_mean(self, x_TD, cache_slot_T, valid_T, num_slots):
    """The mean input of the valid tokens whose first channel is positive, added to every
    token, and each token scaled by its request's count of tokens in the call: the tokens
    picked by a boolean mask (`x[mask]`), by `nonzero` and by `masked_select` -- outputs whose
    size the values decide -- and the counts by `bincount` over the slots."""
    keep_T = valid_T & (x_TD[:, 0] > 0)
    by_mask_D = x_TD[keep_T].sum(0)
    by_index_D = x_TD[torch.nonzero(keep_T).squeeze(1)].sum(0)
    firsts = torch.masked_select(x_TD[:, 0], keep_T).sum()
    kept = keep_T.sum().clamp(min=1)
    mean_D = (by_mask_D + by_index_D) / (2 * kept) + firsts / kept
    slot_T = torch.where(valid_T, cache_slot_T, num_slots)
    counts_S = torch.bincount(slot_T, minlength=num_slots + 1)
    scale_T = 1 + self.mask_weight / counts_S[slot_T].clamp(min=1)
    return x_TD * scale_T[:, None] + self.mask_weight * mean_D


# -- Ops along the expert dim ----------------------------------------------------------------


def _expert_load_bias(model: DeepseekV41, layers: Sequence[Block], generator) -> None:
    """Batch-level load balancing: the router's selection bias lowered, per expert, by the
    share of the batch's valid tokens whose top-k picked the expert without it (a count along
    the expert dim, summed over the tokens)."""
    for layer in layers:
        gate = layer.ffn.gate
        gate.load_scale = _parameter(generator, gate.weight.shape[0], std=0.05, mean=0.2)
        _edit_forward(gate, _load_balanced_router)


def _load_balanced_router(self, x_TD, valid_T):
    scores_TE = torch.sqrt(F.softplus(F.linear(x_TD.float(), self.weight)))
    first_TK = torch.topk(scores_TE + self.bias, self.topk, dim=-1).indices
    picked_TE = torch.zeros_like(scores_TE).scatter(1, first_TK, 1.0) * valid_T[:, None]
    load_E = picked_TE.sum(0) / valid_T.sum().clamp(min=1)
    idx_TK = torch.topk(scores_TE + self.bias - self.load_scale * load_E, self.topk, dim=-1).indices
    weight_TK = scores_TE.gather(1, idx_TK)
    weight_TK = weight_TK / (weight_TK.sum(-1, keepdim=True) + 1e-20) * self.route_scale
    return torch.where(valid_T[:, None], idx_TK, -1), torch.where(valid_T[:, None], weight_TK, 0.0)


_REDUCE_SCATTER_EXIT = (("attn_exit", "reduce_scatter"),)

_EDITS = (
    # new modules and parameters: attention, mHC, the MoE, the head
    Edit(
        "attn_output_gate", "a sigmoid gate on attention's output (new Linear)", _attn_output_gate
    ),
    Edit("hc_post_scale", "a learned scale per mHC stream", _hc_post_scale),
    Edit(
        "shared_expert_gate",
        "a sigmoid gate on the shared expert (new Linear)",
        _shared_expert_gate,
    ),
    Edit("capped_head", "soft-capped logits", _capped_head, in_layers=False),
    # ops on a partial sum (wo_b's, with the attention exit that reduce-scatters it)
    Edit("wo_b_bias", "a bias on the row-parallel wo_b", _wo_b_bias, _REDUCE_SCATTER_EXIT),
    Edit("attn_out_norm", "an RMSNorm of wo_b's partial sum", _attn_out_norm, _REDUCE_SCATTER_EXIT),
    # another activation, another normalisation
    Edit("shared_expert_gelu", "GELU instead of SiLU in the shared expert", _shared_expert_gelu),
    Edit("ffn_layernorm", "LayerNorm instead of RMSNorm before the FFN", _ffn_layernorm),
    # ops along the head dim
    Edit("q_head_scale", "a learned scale per query head", _q_head_scale),
    Edit("q_head_softmax", "query heads reweighted by a softmax across heads", _q_head_softmax),
    # ops along the expert dim
    Edit("router_softmax_topk", "a softmax top-k router", _router_softmax_topk),
    Edit(
        "expert_load_bias",
        "a batch expert-load bias (expert dim, summed over the tokens)",
        _expert_load_bias,
        mixes_tokens=True,
    ),
    # ops along the token dim
    Edit(
        "ffn_batch_centering",
        "the FFN input minus its mean over the valid tokens",
        _mixing("ffn", _batch_centering, centering=()),
        mixes_tokens=True,
    ),
    Edit(
        "ffn_batch_scale",
        "the FFN input scaled by its max and mean square over the batch",
        _mixing("ffn", _batch_scale, amax_weight=()),
        mixes_tokens=True,
    ),
    Edit(
        "token_shift_cat",
        "a token shift of the attention input within a request (slices and cat)",
        _mixing("attention", _token_shift_cat, shift_mix=("D",)),
        mixes_tokens=True,
    ),
    Edit(
        "token_shift_roll",
        "a token shift of the FFN input within a request (torch.roll)",
        _mixing("ffn", _token_shift_roll, roll_mix=("D",)),
        mixes_tokens=True,
    ),
    Edit(
        "token_diff",
        "the difference from the previous token (torch.diff)",
        _mixing("ffn", _token_diff, diff_mix=("D",)),
        mixes_tokens=True,
    ),
    Edit(
        "causal_conv",
        "a short causal depthwise conv of the attention input within a request (padded shifts)",
        _mixing("attention", _causal_conv, conv_weight=(4, "D")),
        mixes_tokens=True,
    ),
    Edit(
        "conv1d_over_batch",
        "a causal depthwise F.conv1d of the FFN input over the batch",
        _mixing("ffn", _conv1d_over_batch, conv1d_weight=(4,)),
        mixes_tokens=True,
    ),
    Edit(
        "request_running_mean",
        "a running mean of the attention input within a request (cumsum and a gather)",
        _mixing("attention", _request_running_mean, running_mean_weight=()),
        mixes_tokens=True,
    ),
    # reductions keyed by request (an index along the tokens)
    Edit(
        "request_mean_index_add",
        "the FFN input plus its request's mean (index_add over the slots, divided by counts)",
        _mixing("ffn", _request_mean_index_add, request_mean_weight=()),
        mixes_tokens=True,
    ),
    Edit(
        "request_max_scatter_reduce",
        "the attention input plus its request's max per channel (scatter_reduce amax)",
        _mixing("attention", _request_max_scatter_reduce, request_max_weight=()),
        mixes_tokens=True,
    ),
    Edit(
        "request_mean_scatter_reduce",
        "the FFN input plus its request's mean (scatter_reduce mean, include_self=False)",
        _mixing("ffn", _request_mean_scatter_reduce, scatter_mean_weight=()),
        mixes_tokens=True,
    ),
    # tokens picked by a mask: outputs sized by the values
    Edit(
        "masked_token_mean",
        "the FFN input plus the mean of the tokens a mask keeps (x[mask], nonzero, "
        "masked_select), scaled by its request's token count (bincount)",
        _mixing("ffn", _masked_token_mean, mask_weight=()),
        mixes_tokens=True,
        dynamo_config=(("capture_dynamic_output_shape_ops", True),),
    ),
    # tokens selected by value (by a score of each token), the selected rows reaching every
    # token: the selection ops along the tokens, each read with another op
    Edit(
        "top_tokens_mean",
        "the mean of the attention input's top-2 tokens by a score added to every token (topk, "
        "x[top_K])",
        _mixing("attention", _top_tokens_mean, top_probe=("D",), top_weight=()),
        mixes_tokens=True,
    ),
    Edit(
        "top_token_row",
        "the FFN input's top token by a score added to every token (argmax, x[top_1])",
        _mixing("ffn", _top_token_row, row_probe=("D",), row_weight=()),
        mixes_tokens=True,
    ),
    Edit(
        "sorted_tokens_blend",
        "the attention input's top-3 tokens by a score, blended, added to every token "
        "(argsort, index_select)",
        _mixing("attention", _sorted_tokens_blend, blend_probe=("D",), blend_weight=()),
        mixes_tokens=True,
    ),
    Edit(
        "max_token_gather",
        "the FFN input's top token by a score added to every token (max(dim=0), gather)",
        _mixing("ffn", _max_token_gather, max_probe=("D",), max_weight=()),
        mixes_tokens=True,
    ),
    # reads and writes at computed token indices
    Edit(
        "top_token_boost",
        "the attention input's top token scaled (x[top] = x[top] * c, a tensor index)",
        _mixing("attention", _top_token_boost, top_boost=()),
        mixes_tokens=True,
    ),
)
EDITS: dict[str, Edit] = {edit.name: edit for edit in _EDITS}
"""The corpus, by name."""
