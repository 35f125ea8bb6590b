"""The single-device DeepSeek V4.1 model: embedding -> delayed-mHC decoder blocks -> terminal
collapse -> norm -> untied head.

Single-device code: no ranks, no collectives, no `.item()` / `.tolist()` in `forward`. Sharding
lives in the compiler, never here.

Legend: T tokens, N mHC streams, D hidden, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv41_compile.model.attention import Attention, rope_frequencies
from dsv41_compile.model.cache import KVCache, LayerCache
from dsv41_compile.model.config import LayerRole, ModelConfig, layer_plan
from dsv41_compile.model.engram import Engram, EngramHash, EngramTable
from dsv41_compile.model.layers import (
    Embedding,
    Fp32Linear,
    HyperConnection,
    RMSNorm,
    hc_collapse,
    hc_expand,
)
from dsv41_compile.model.moe import MoE
from dsv41_compile.model.numerics import fp4_rows_width, fp8_rows_width
from dsv41_compile.model.quant import quantize_fp8
from dsv41_compile.model.released import Fp8Linear
from dsv41_compile.storage import has_no_weights

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

    def __init__(self, cfg: ModelConfig, layer_id: int, role: LayerRole) -> None:
        super().__init__()
        self.layer_id = layer_id
        if layer_id in cfg.engram_layer_ids:
            self.engram = Engram(cfg, cfg.engram_primes[cfg.engram_layer_ids.index(layer_id)])
        self.hc_attn = HyperConnection(cfg)
        self.attn_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_id, role)
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

        ffn_pre_TN, ffn_post_TN, ffn_comb_TNN = self.hc_ffn(x_TND)
        ffn_in_TD = self.ffn_norm(hc_collapse(x_TND, attn_pre_TN))
        ffn_out_TD = self.ffn(ffn_in_TD, valid_T)
        x_TND = hc_expand(x_TND, ffn_out_TD, ffn_post_TN, ffn_comb_TNN)
        return (x_TND, ffn_pre_TN, *made)


class DeepseekV41(nn.Module):
    """`model(input_ids, positions, slots, cache) -> logits [T, vocab] float32`.

    Inputs are packed ragged batches: int64 [T] each. `slots[t]` is token t's request (cache
    slot), `positions[t]` its position there; a request's tokens are contiguous, with increasing
    positions continuing what the cache holds (check with `validate_batch`). `slots[t] == -1`
    marks a padding row: it writes no cache row, is routed to no expert, changes no other row,
    and its logits are zero. The cache is mutated in place.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.dim, dtype=cfg.torch_dtype)
        if cfg.engram_layer_ids:
            self.engram_hash = EngramHash(cfg)
        self.plan = layer_plan(cfg)
        self.layers = nn.ModuleList(Block(cfg, i, role) for i, role in enumerate(self.plan))
        self.norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        # fp32 weight and logits, as the official head (bf16 in the checkpoint)
        self.head = Fp32Linear(cfg.dim, cfg.vocab_size, bias=False, dtype=torch.float32)
        self.reset_parameters()
        # Inference-only: the routed-experts op has no autograd formula, and AOT would otherwise
        # trace a joint forward/backward graph whenever the caller forgets `no_grad`.
        self.requires_grad_(False)

    @classmethod
    def without_weights(cls, cfg: ModelConfig) -> DeepseekV41:
        """The model with no memory behind its parameters: each is a zero broadcast to its
        shape. It is for the `dsv41_sp` backend's `checkpoint` option, where each rank reads
        only its own shards at compile time, and for `load_checkpoint`, which allocates the
        parameters it fills. Called eagerly, it raises. (A model on the meta device cannot be
        compiled: Dynamo refuses ops that mix its meta parameters with CPU inputs.)"""
        with torch.device("meta"):
            model = cls(cfg)
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                empty = torch.zeros((), dtype=param.dtype).expand(param.shape)
                setattr(module, name, nn.Parameter(empty, requires_grad=False))
        for layer in model.layers:  # the buffers: computed from the config, on the CPU
            layer.attn.rope_inv_freq = rope_frequencies(cfg, layer.attn.role)
        if cfg.engram_layer_ids:
            for name, buffer in EngramHash(cfg).named_buffers():
                setattr(model.engram_hash, name, buffer)
        return model

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic under `torch.manual_seed`: fan-in-scaled normals, unit norms, and mHC /
        router / sink parameters in ranges where every code path is exercised."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=module.in_features**-0.5)
            elif isinstance(module, Fp8Linear):
                module.reset_parameters()
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight)
            elif isinstance(module, HyperConnection):
                nn.init.normal_(module.fn, std=module.fn.shape[1] ** -0.5)
                nn.init.normal_(module.base, std=0.5)
                nn.init.uniform_(module.scale, 0.5, 1.5)
            elif isinstance(module, Attention):
                nn.init.normal_(module.attn_sink)
            elif isinstance(module, EngramTable) and not module.weight.is_meta:
                rows = torch.randn(module.weight.shape) * 2.0 ** torch.randint(-4, 2, (1,))
                module.weight.data, module.scale.data = quantize_fp8(rows, rows=1)
            elif isinstance(module, MoE):
                module.experts.reset_parameters()
                nn.init.normal_(module.gate.weight, std=module.gate.weight.shape[1] ** -0.5)
                nn.init.normal_(module.gate.bias, std=0.1)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        """An empty cache for `num_slots` requests of up to `max_len` positions each. Under the
        official numerics the window KV is FP8 and the compressed KV FP4, each row its codes
        and then its scales (`numerics.fp8_rows`, `numerics.fp4_rows`)."""
        if num_slots <= 0 or max_len <= 0:
            raise ValueError(f"num_slots and max_len must be positive, got {num_slots}, {max_len}")
        cfg, device = self.cfg, self.embed.weight.device
        rows = num_slots + 1  # + the scratch slot

        def zeros(*shape: int, dtype: torch.dtype = cfg.torch_dtype) -> Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        def kv(entries: int, quantised: bool, row_width: int) -> Tensor:
            """`entries` KV rows per slot: bytes of quantised rows, or values."""
            if quantised:
                return zeros(rows, entries, row_width, dtype=torch.uint8)
            return zeros(rows, entries, cfg.head_dim)

        rounding, d = cfg.rounding, cfg.head_dim
        sources = {i: role.ratio for i, role in enumerate(self.plan) if role.mode == "full"}
        return KVCache(
            num_slots=num_slots,
            max_len=max_len,
            lengths=zeros(num_slots, dtype=torch.int64),
            window_kv=[
                kv(cfg.window_size, rounding.window_kv, fp8_rows_width(d))
                for _ in range(cfg.n_layers)
            ],
            compressed_kv={
                i: kv(-(-max_len // r), rounding.compressed_kv, fp4_rows_width(d))
                for i, r in sources.items()
            },
            index_k={
                i: zeros(rows, -(-max_len // r), cfg.index_head_dim) for i, r in sources.items()
            },
            pair_state={
                i: zeros(rows, 2 * cfg.head_dim, dtype=torch.float32)
                for i, r in sources.items()
                if r == 2
            },
            ngram=[
                zeros(rows, dtype=torch.int64)
                for _ in range(cfg.engram_max_ngram_size - 1 if cfg.engram_layer_ids else 0)
            ],
        )

    def forward(
        self, input_ids: Tensor, positions: Tensor, slots: Tensor, cache: KVCache
    ) -> Tensor:
        weight = self.embed.weight  # a meta model runs on meta inputs only (planning)
        if (weight.device.type == "meta") != (input_ids.device.type == "meta") or (
            not torch.compiler.is_compiling() and not weight.is_meta and has_no_weights(weight)
        ):
            raise ValueError(
                "this DeepseekV41 has no weights (built on the meta device or by "
                "DeepseekV41.without_weights): call load_checkpoint(model, DIR) first, or "
                "compile DeepseekV41.without_weights(cfg) with the dsv41_sp backend's option "
                "checkpoint=DIR, where each rank reads only its own shards"
            )
        valid_T = slots >= 0
        cache_slot_T = torch.where(valid_T, slots, cache.scratch_slot)

        h_TD = self.embed(input_ids)
        # A broadcast view, not a copy: layer 0 is then a kind of its own for torch.compile
        # (its streams have another layout), which costs one trace and no copy of [T, N, D].
        x_TND = h_TD[:, None, :].expand(-1, self.cfg.hc_mult, -1)
        # One-hot incoming pre: layer 0's attention input is exactly the embedding.
        pre_TN = F.one_hot(torch.zeros_like(input_ids), self.cfg.hc_mult).float()
        engram_LTC = None
        if self.cfg.engram_layer_ids:
            engram_LTC = self.engram_hash(input_ids, positions, slots, cache_slot_T, cache.ngram)
        topk: dict[int, tuple[Tensor, Tensor]] = {}  # each index source's, this batch only
        candidates_TC = None
        for layer, role in zip(self.layers, self.plan):
            engram_TC = None
            if layer.layer_id in self.cfg.engram_layer_ids:
                engram_TC = engram_LTC[self.cfg.engram_layer_ids.index(layer.layer_id)]
            topk_TK = topk[role.topk_source] if role.mode == "reuse" else (None, None)
            x_TND, pre_TN, *made = layer(
                x_TND,
                pre_TN,
                positions,
                cache_slot_T,
                valid_T,
                *cache.layer(layer.layer_id, role.kv_source),
                *topk_TK,
                candidates_TC if role.candidate_filtered else None,
                engram_TC,
            )
            if made:
                topk[layer.layer_id] = (made[0], made[1])
            if role.makes_candidates:
                candidates_TC = made[2]

        # The last FFN site's pre collapses the streams (V4.1 has no learned hc_head).
        y_TD = self.norm(hc_collapse(x_TND, pre_TN))
        logits_TV = self.head(y_TD).masked_fill(~valid_T[:, None], 0.0)

        held = torch.where(valid_T, positions + 1, 0)
        cache.lengths.scatter_reduce_(0, cache_slot_T.clamp(max=cache.num_slots - 1), held, "amax")
        return logits_TV
