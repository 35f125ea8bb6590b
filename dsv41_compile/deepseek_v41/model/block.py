"""One V4.1 decoder layer (`Block`): delayed mHC around attention and the MoE, an Engram
lookup first where the config has one. `model.DeepseekV41` stacks them; a DSpark stage
(`model.dspark`) is one with another attention.

Legend: T tokens, N mHC streams, D hidden.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dsv41_compile.deepseek_v41.model.attention import Attention
from dsv41_compile.deepseek_v41.model.cache import LayerCache
from dsv41_compile.deepseek_v41.model.config import LayerRole, ModelConfig
from dsv41_compile.deepseek_v41.model.engram import Engram
from dsv41_compile.deepseek_v41.model.layers import HyperConnection, RMSNorm, hc_collapse, hc_expand
from dsv41_compile.deepseek_v41.model.moe import MoE

# Distinct layer kinds `torch.compile` may keep (nested_compile_region's reuse entries, each a
# traced kind): V4.1 has about six; the bound only has to exceed any layer count, where every
# layer would be a kind of its own.
_LAYER_KINDS = 256


class Block(nn.Module):
    """One V4.1 decoder layer with *delayed* mHC pre: the `pre` mix computed at one sublayer
    collapses the input of the next sublayer (the incoming `pre_TN` collapses this attention's
    input; this attention site's `pre` collapses the FFN input; the FFN site's `pre` goes out).

    A layer is a function of its inputs alone: the part of the cache it reads and writes
    (`KVCache.layer`), the top-k it reuses, the candidate mask it filters with. So every layer of a kind
    (window-only, a kv source of ratio 1 or 2, REINDEX, REUSE, ...) is the same function with
    other weights, and `torch.compile` traces each kind once (`nested_compile_region`; eager
    calls it as it is)."""

    attention_cls: type[Attention] = Attention
    ffn_norm: nn.Module  # RMSNorm as released (an edited model may norm otherwise)

    def __init__(self, cfg: ModelConfig, layer_id: int, role: LayerRole) -> None:
        super().__init__()
        self.layer_id = layer_id
        if layer_id in cfg.engram_layer_ids:
            self.engram = Engram(cfg, cfg.engram_primes[cfg.engram_layer_ids.index(layer_id)])
        self.hc_attn = HyperConnection(cfg)
        self.attn_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.attn = self.attention_cls(cfg, layer_id, role)
        self.hc_ffn = HyperConnection(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.ffn = MoE(cfg)

    @torch.compiler.nested_compile_region(max_reuse_entries=_LAYER_KINDS)
    def forward(
        self,
        x_TND: Tensor,
        pre_TN: Tensor,
        positions_T: Tensor,
        cache_slot_T: Tensor,
        valid_T: Tensor,
        num_slots: int,
        lengths: Tensor,
        window: Tensor,
        compressed: Tensor | None,
        index_k: Tensor | None,
        pair_state: Tensor | None,
        idx_TK: Tensor | None,
        picked_TK: Tensor | None,
        candidates_TC: Tensor | None,
        engram_rows_TC: Tensor | None,
    ) -> tuple[Tensor, ...]:
        """`(x_TND, pre_TN, *made)`: the streams, the FFN site's pre, and what the attention
        makes for later layers (`Attention.forward`). An Engram layer first adds its n-gram
        memory to the incoming streams (`engram_rows_TC`: its table rows per token); the
        attention input still mixes them with the previous layer's `pre_TN`.

        `num_slots` .. `pair_state` are the layer's `LayerCache`; `idx_TK, picked_TK` the
        top-k a REUSE layer reuses, `candidates_TC` the mask a candidate-filtered layer reads
        (None where the layer reads none). Inputs and outputs are flat tensors and constants:
        Dynamo matches those against a region's traced kinds directly, where it would trace
        pytree to flatten a structure and guard the compiled model on pytree's registry."""
        kv = LayerCache(num_slots, lengths, window, compressed, index_k, pair_state)
        topk = None if idx_TK is None or picked_TK is None else (idx_TK, picked_TK)
        if engram_rows_TC is not None:
            x_TND = self.engram(x_TND, engram_rows_TC)
        attn_pre_TN, attn_post_TN, attn_comb_TNN = self.hc_attn(x_TND)
        attn_in_TD = self.attn_norm(hc_collapse(x_TND, pre_TN))
        attn_out_TD, made = self.attn(
            attn_in_TD, positions_T, cache_slot_T, kv, topk, candidates_TC
        )
        x_TND = hc_expand(x_TND, attn_out_TD, attn_post_TN, attn_comb_TNN)
        x_TND, ffn_pre_TN = self.moe_half(x_TND, attn_pre_TN, valid_T)
        return (x_TND, ffn_pre_TN, *made)

    def moe_half(
        self, x_TND: Tensor, attn_pre_TN: Tensor, valid_T: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The MoE half: its input collapsed with the attention site's `pre`; the streams and
        the FFN site's `pre`, which goes out."""
        ffn_pre_TN, ffn_post_TN, ffn_comb_TNN = self.hc_ffn(x_TND)
        ffn_in_TD = self.ffn_norm(hc_collapse(x_TND, attn_pre_TN))
        ffn_out_TD = self.ffn(ffn_in_TD, valid_T)
        return hc_expand(x_TND, ffn_out_TD, ffn_post_TN, ffn_comb_TNN), ffn_pre_TN
