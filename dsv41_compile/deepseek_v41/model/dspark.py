"""DSpark: V4.1's draft blocks (`mtp.0 ..` in the checkpoint), which propose the
`dspark_block_size` tokens that follow the backbone's next token (`serving` verifies them).

The drafter reads the backbone: the mean over the mHC streams of the residual entering each
of `dspark_target_layer_ids` (after Engram), concatenated (`DeepseekV41.forward(...,
hidden=True)`), projected back to `dim` and normalised: `main_x`, one row per position the
backbone has processed. Each stage is a window-only V4.1 block with its own weights and
experts (`ModelConfig.dspark_stage`); the embedding and the head are the backbone's.

A draft block is `dspark_block_size` rows `[t, noise, noise, ...]` at positions `p+1 ..`, where
`t` is the token at p+1 and the stages' rings hold the context KV of positions `.. p`. In every
stage each block row attends to

- the ring's rows, in ring-slot order (as the official kernel walks them): the stage's
  `kv_norm(wkv(main_x))`, rotated at its position, of the last `window_size` positions up to p;
- every row of its own block (the block is not causal).

The head's logits get a Markov bias of the previous token (`MarkovHead`) before each draft is
sampled: row i's logits, biased by the token at row i, give the token at row i + 1. That chain
is sequential and data dependent, so it is not in `forward` (`serving.propose`).

The context is written by the call that reads it: a call takes the `main_x` rows of the
positions committed since the last one (`hidden`, `hidden_positions`, `hidden_slots`), writes
them into every stage's ring, then runs the blocks. Rows of rejected drafts are never written:
the drafter's cache never needs a rollback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv41_compile.deepseek_v41.model.attention import Attention, write_window
from dsv41_compile.deepseek_v41.model.block import Block
from dsv41_compile.deepseek_v41.model.config import LayerRole, ModelConfig
from dsv41_compile.deepseek_v41.model.layers import (
    Embedding,
    Fp32Linear,
    RMSNorm,
    hc_collapse,
    hc_expand,
)
from dsv41_compile.deepseek_v41.model.numerics import (
    act_quant_dequant,
    fp8_rows_width,
    from_fp8_rows,
)
from dsv41_compile.deepseek_v41.model.released import linear

__all__ = ["DSparkDrafter", "DraftCache"]

_SWA = LayerRole(mode="swa", ratio=0)


@dataclass
class DraftCache:
    """The drafter's cache: per stage a ring of context KV, position p in row `p % window_size`
    (FP8 rows under the official numerics, as the backbone's window), plus the scratch slot at
    index `num_slots` for padding rows."""

    num_slots: int
    lengths: Tensor
    """int64 [num_slots]: positions whose context each slot holds (the next one to write)."""
    window: list[Tensor]
    """Per stage, [num_slots + 1, window_size, head_dim] (official numerics: uint8 FP8 rows)."""

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    def tensors(self) -> list[Tensor]:
        return [self.lengths, *self.window]


class DSparkAttention(Attention):
    """A stage's attention: the block rows' queries over the ring of context KV (written
    first, from `main_x`) and over the rows of their own block."""

    def forward(  # type: ignore[override]
        self,
        x_TD: Tensor,
        positions_T: Tensor,
        cache_slot_T: Tensor,
        main_x_TD: Tensor,
        main_positions_T: Tensor,
        main_slot_T: Tensor,
        ring: Tensor,
        lengths: Tensor,
        num_slots: int,
        block_size: int,
    ) -> Tensor:
        rounding, W, T = self.rounding, self.window, x_TD.shape[0]
        quantised = rounding.gemm_inputs
        gemm_x_TD = act_quant_dequant(x_TD) if quantised else x_TD
        _, q_THd = self.queries(gemm_x_TD, positions_T)
        kv_Td, _ = self.window_kv(gemm_x_TD, positions_T)
        gemm_main_TD = act_quant_dequant(main_x_TD) if quantised else main_x_TD
        _, main_rows_Td = self.window_kv(gemm_main_TD, main_positions_T)
        write_window(ring, W, main_rows_Td, main_slot_T, main_positions_T)

        real_T = cache_slot_T != num_slots
        held_T = lengths[cache_slot_T.clamp(max=num_slots - 1)]
        ring_TWd = ring[cache_slot_T]
        if rounding.window_kv:
            ring_TWd = from_fp8_rows(ring_TWd)
        # slots 0 .. held-1 until the ring is full, then all of them: positions held-W .. held-1
        slots_W = torch.arange(W, device=x_TD.device)
        ring_visible_TW = (slots_W[None, :] < held_T[:, None]) & real_T[:, None]
        # the rows of each row's block: it starts at the slot's held position
        offset_T = positions_T - held_T
        rows_B = torch.arange(block_size, device=x_TD.device)
        index_TB = torch.arange(T, device=x_TD.device)[:, None] - offset_T[:, None] + rows_B
        inside_TB = (index_TB >= 0) & (index_TB < T)
        index_TB = index_TB.clamp(min=0, max=max(T - 1, 0))
        block_visible_TB = inside_TB & (cache_slot_T[index_TB] == cache_slot_T[:, None])
        block_visible_TB = block_visible_TB & real_T[:, None]
        keys_TSd = torch.cat((ring_TWd, kv_Td[index_TB]), dim=1)
        visible_TS = torch.cat((ring_visible_TW, block_visible_TB), dim=1)
        return self.attend(q_THd, keys_TSd, visible_TS, positions_T)


class DSparkBlock(Block):
    """One stage: a window-only V4.1 block (`Block`'s mHC, norms and MoE, no Engram) whose
    attention is `DSparkAttention`."""

    attention_cls = DSparkAttention

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__(cfg, layer_id, _SWA)

    @torch.compiler.nested_compile_region
    def forward(  # type: ignore[override]
        self,
        x_TND: Tensor,
        pre_TN: Tensor,
        positions_T: Tensor,
        cache_slot_T: Tensor,
        valid_T: Tensor,
        main_x_TD: Tensor,
        main_positions_T: Tensor,
        main_slot_T: Tensor,
        ring: Tensor,
        lengths: Tensor,
        num_slots: int,
        block_size: int,
    ) -> tuple[Tensor, Tensor]:
        attn_pre_TN, attn_post_TN, attn_comb_TNN = self.hc_attn(x_TND)
        attn_in_TD = self.attn_norm(hc_collapse(x_TND, pre_TN))
        attn_out_TD = self.attn(
            attn_in_TD,
            positions_T,
            cache_slot_T,
            main_x_TD,
            main_positions_T,
            main_slot_T,
            ring,
            lengths,
            num_slots,
            block_size,
        )
        x_TND = hc_expand(x_TND, attn_out_TD, attn_post_TN, attn_comb_TNN)
        return self.moe_half(x_TND, attn_pre_TN, valid_T)


class MarkovHead(nn.Module):
    """`forward(tokens) -> (bias [T, V] fp32, embedding [T, R])`: a rank-R embedding of the
    previous token and its product with an fp32 `[V, R]` head, added to a draft row's logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        rank = cfg.dspark_markov_rank
        self.embed = Embedding(cfg.vocab_size, rank, dtype=cfg.torch_dtype)
        self.head = Fp32Linear(rank, cfg.vocab_size, bias=False, dtype=torch.float32)

    def forward(self, tokens_T: Tensor) -> tuple[Tensor, Tensor]:
        embed_TR = self.embed(tokens_T)
        return self.head(embed_TR), embed_TR


class ConfidenceHead(nn.Module):
    """A scalar per draft row, fp32, from the row's collapsed stage output and its Markov
    embedding. Reported, not used to accept anything."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.proj = Fp32Linear(cfg.dim + cfg.dspark_markov_rank, 1, bias=False, dtype=torch.float32)

    def forward(self, x_TD: Tensor, embed_TR: Tensor) -> Tensor:
        return self.proj(torch.cat((x_TD.float(), embed_TR.float()), dim=-1)).squeeze(-1)


class DSparkDrafter(nn.Module):
    """`drafter(input_ids, positions, slots, cache, hidden, hidden_positions, hidden_slots)
    -> (logits [T, V] fp32, x [T, D])`.

    `input_ids, positions, slots`: packed draft blocks, `dspark_block_size` rows per request,
    each block starting at the position its slot's context reaches after this call (`slots ==
    -1`: padding). `hidden [H, len(targets) * D]` with its own positions and slots: the
    backbone's captures (`DeepseekV41.forward(..., hidden=True)`) of the positions to add to
    the context, contiguous from what `cache` holds. Returns the head's logits without the
    Markov bias (zero in padding rows) and the collapsed last stage output (for
    `ConfidenceHead`). `cache` (`new_cache`) is mutated in place.

    Built by `DeepseekV41` when the config has DSpark stages (`model.mtp`): `embed` and `head`
    are the backbone's modules."""

    def __init__(self, cfg: ModelConfig, embed: nn.Module, head: nn.Module) -> None:
        super().__init__()
        if not cfg.num_nextn_predict_layers:
            raise ValueError("DSparkDrafter: the config has no DSpark stages")
        self.cfg, self.rounding = cfg, cfg.rounding
        stage, dim = cfg.dspark_stage, cfg.dim
        released = cfg.weight_format == "released"
        self.embed, self.head = embed, head
        width = dim * len(cfg.dspark_target_layer_ids)
        self.main_proj = linear(width, dim, released=released, dtype=cfg.torch_dtype)
        self.main_norm = RMSNorm(dim, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(
            DSparkBlock(stage, cfg.n_layers + i) for i in range(cfg.num_nextn_predict_layers)
        )
        self.norm = RMSNorm(dim, cfg.rms_norm_eps)
        self.markov_head = MarkovHead(cfg)
        self.confidence_head = ConfidenceHead(cfg)

    def new_cache(self, num_slots: int) -> DraftCache:
        """An empty drafter cache for `num_slots` requests."""
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        cfg, device = self.cfg, self.main_norm.weight.device
        if cfg.rounding.window_kv:
            shape, dtype = (fp8_rows_width(cfg.head_dim),), torch.uint8
        else:
            shape, dtype = (cfg.head_dim,), cfg.torch_dtype
        rows = (num_slots + 1, cfg.window_size, *shape)
        return DraftCache(
            num_slots=num_slots,
            lengths=torch.zeros(num_slots, dtype=torch.int64, device=device),
            window=[torch.zeros(rows, dtype=dtype, device=device) for _ in self.layers],
        )

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        slots: Tensor,
        cache: DraftCache,
        hidden: Tensor,
        hidden_positions: Tensor,
        hidden_slots: Tensor,
    ) -> tuple[Tensor, Tensor]:
        cfg, scratch = self.cfg, cache.scratch_slot
        valid_T = slots >= 0
        cache_slot_T = torch.where(valid_T, slots, scratch)
        main_valid_H = hidden_slots >= 0
        main_slot_H = torch.where(main_valid_H, hidden_slots, scratch)
        main_in = act_quant_dequant(hidden) if self.rounding.gemm_inputs else hidden
        main_x_HD = self.main_norm(self.main_proj(main_in))
        held_H = torch.where(main_valid_H, hidden_positions + 1, 0)
        cache.lengths.scatter_reduce_(0, main_slot_H.clamp(max=cache.num_slots - 1), held_H, "amax")

        h_TD = self.embed(input_ids)
        x_TND = h_TD[:, None, :].expand(-1, cfg.hc_mult, -1)
        pre_TN = F.one_hot(torch.zeros_like(input_ids), cfg.hc_mult).float()
        for layer, ring in zip(self.layers, cache.window):
            x_TND, pre_TN = layer(
                x_TND,
                pre_TN,
                positions,
                cache_slot_T,
                valid_T,
                main_x_HD,
                hidden_positions,
                main_slot_H,
                ring,
                cache.lengths,
                cache.num_slots,
                cfg.dspark_block_size,
            )
        x_TD = hc_collapse(x_TND, pre_TN)
        logits_TV = self.head(self.norm(x_TD)).masked_fill(~valid_T[:, None], 0.0)
        return logits_TV, x_TD
