"""The single-device DeepSeek V4.1 model: embedding -> delayed-mHC decoder blocks -> terminal
collapse -> norm -> untied head.

Single-device code: no ranks, no collectives, no `.item()` / `.tolist()` in `forward`. Sharding
lives in the compiler, never here.

Legend: T tokens, N mHC streams, D hidden, V vocab.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv41_compile.deepseek_v41.model.attention import Attention, rope_frequencies
from dsv41_compile.deepseek_v41.model.block import Block
from dsv41_compile.deepseek_v41.model.cache import KVCache, SavedRows
from dsv41_compile.deepseek_v41.model.config import ModelConfig, layer_plan
from dsv41_compile.deepseek_v41.model.dspark import DSparkDrafter
from dsv41_compile.deepseek_v41.model.engram import EngramHash, EngramTable
from dsv41_compile.deepseek_v41.model.layers import (
    Embedding,
    Fp32Linear,
    HyperConnection,
    RMSNorm,
    hc_collapse,
)
from dsv41_compile.deepseek_v41.model.moe import MoE
from dsv41_compile.deepseek_v41.model.numerics import fp4_rows_width, fp8_rows_width
from dsv41_compile.deepseek_v41.model.quant import quantize_fp8
from dsv41_compile.deepseek_v41.model.released import Fp8Linear
from dsv41_compile.deepseek_v41.model.validate import check_batch_shapes, refuse
from dsv41_compile.storage import has_no_weights


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
        if cfg.num_nextn_predict_layers:  # the DSpark draft blocks, sharing embed and head
            self.mtp = DSparkDrafter(cfg, self.embed, self.head)
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
        stages: Iterable[nn.Module] = model.mtp.layers if cfg.num_nextn_predict_layers else []
        for layer in [*model.layers, *stages]:  # the buffers: from the config, on the CPU
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

    def save_rows(self, cache: KVCache, slot: int, first: int, count: int) -> SavedRows:
        """The rows of `cache` a call feeding positions `first .. first + count - 1` of `slot`
        may write, as they are now: to cut the cache back after the call (`cut_cache`), as
        speculative decoding does with rejected drafts (`serving`). The call's rows must take
        distinct rows of the window ring (`count <= window_size`)."""
        cfg = self.cfg
        if count > cfg.window_size:
            raise ValueError(
                f"a call of {count} positions writes some window-ring rows twice (window_size "
                f"{cfg.window_size}): its cache cannot be cut back; feed at most window_size "
                "positions per request in a call that may be cut"
            )
        written = list(range(first, first + count))
        saved = SavedRows(slot, first)

        def keep(tensor: Tensor, rows: list[int], writers: list[int]) -> None:
            saved.rows.append((tensor, (slot, rows), tensor[slot, rows].clone(), writers))

        for ring in cache.window_kv:
            keep(ring, [q % cfg.window_size for q in written], written)
        for source, role in ((i, r) for i, r in enumerate(self.plan) if r.mode == "full"):
            # an entry is written by the position that completes it
            writers = [q for q in written if (q + 1) % role.ratio == 0]
            entries = [q // role.ratio for q in writers]
            keep(cache.compressed_kv[source], entries, writers)
            keep(cache.index_k[source], entries, writers)
            if source in cache.pair_state:  # written by the call's last position if it opens a pair
                state = cache.pair_state[source]
                last = written[-1]
                saved.rows.append((state, (slot, [0]), state[slot].clone()[None], [last]))
        return saved

    def cache_cut(self, length: int) -> int:
        """The longest length <= `length` a call's cache can be cut back to: with a ratio-2
        compressor an even one, since the first position of an open pair is kept only where
        a call ends (`Compressor`); the position it drops is fed again."""
        ratio2 = any(r.mode == "full" and r.ratio == 2 for r in self.plan)
        return length - length % 2 if ratio2 else length

    @torch.no_grad()
    def cut_cache(self, cache: KVCache, saved: SavedRows, length: int, tokens: list[int]) -> None:
        """Cut slot `saved.slot` of `cache` back to its first `length` positions (a
        `cache_cut` length, at least what it held before the call `saved` was taken for): the
        rows later positions wrote are put back, and the request's n-gram history is rebuilt
        from `tokens`, its tokens from position 0. The cache is then what a call that fed only
        the kept positions leaves."""
        if length < saved.first or length != self.cache_cut(length):
            raise ValueError(
                f"cannot cut slot {saved.slot} to {length} positions: it held {saved.first} "
                f"before the call, and the cut must be a cache_cut length"
            )
        slot = saved.slot
        for tensor, (_, rows), values, writers in saved.rows:
            back = [i for i, q in enumerate(writers) if q >= length]
            if back:
                if tensor.dim() == 2:  # a per-slot row
                    tensor[slot] = values[0]
                else:
                    tensor[slot, [rows[i] for i in back]] = values[back]
        cache.lengths[slot] = length
        if cache.ngram:
            hash_ = self.engram_hash
            if has_no_weights(hash_.token_map):
                raise ValueError(
                    "cut_cache rebuilds the Engram n-gram history with the token map, which this "
                    "model does not hold (built by without_weights, its weights read per rank by "
                    "the checkpoint option): load it with load_checkpoint(model, DIR) first"
                )
            pad = int(hash_.token_map[hash_.pad_id])
            for j, history in enumerate(cache.ngram):
                q = length - 1 - j
                history[slot] = int(hash_.token_map[tokens[q]]) if q >= 0 else pad

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        slots: Tensor,
        cache: KVCache,
        hidden: bool = False,
        logit_rows: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The logits, `[T, V]`; with `hidden=True` (a model with DSpark stages) also what the
        drafter reads, `[T, len(dspark_target_layer_ids) * D]`: per target layer the mean over
        the mHC streams of the residual entering it, concatenated (zero in padding rows).

        `logit_rows`: the rows whose logits to return, `[R]` integer indices into the batch
        (the last row of each request at prefill, a speculative step's verify rows): the
        logits are then `[R, V]`, row i that of batch row `logit_rows[i]`, and the head
        multiplies only those rows. All T rows when None."""
        # Its refusals end a Dynamo trace without running the forward eagerly (`refuse`).
        check_batch_shapes(input_ids, positions, slots, logit_rows)
        if hidden and not self.cfg.num_nextn_predict_layers:
            refuse(
                "hidden=True returns what the DSpark drafter reads; this model's config has no "
                "DSpark stages (num_nextn_predict_layers = 0)"
            )
        weight = self.embed.weight  # a meta model runs on meta inputs only (planning)
        if (weight.device.type == "meta") != (input_ids.device.type == "meta") or (
            not torch.compiler.is_compiling() and not weight.is_meta and has_no_weights(weight)
        ):
            refuse(
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
        captured: list[Tensor] = []
        for layer, role in zip(cast(Iterable[Block], self.layers), self.plan):
            if hidden and layer.layer_id in self.cfg.dspark_target_layer_ids:
                captured.append(x_TND.mean(1))
            engram_TC = None
            if layer.layer_id in self.cfg.engram_layer_ids:
                assert engram_LTC is not None, "hashed above for the Engram layers"
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
        if logit_rows is None:
            logits_TV = self.head(y_TD).masked_fill(~valid_T[:, None], 0.0)
        else:  # [R, V]
            logits_TV = self.head(y_TD[logit_rows]).masked_fill(~valid_T[logit_rows, None], 0.0)

        held = torch.where(valid_T, positions + 1, 0)
        cache.lengths.scatter_reduce_(0, cache_slot_T.clamp(max=cache.num_slots - 1), held, "amax")
        if hidden:
            return logits_TV, torch.cat(captured, dim=-1).masked_fill(~valid_T[:, None], 0.0)
        return logits_TV
