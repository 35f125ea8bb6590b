"""V4.1 attention: low-rank queries, one shared KV latent (MQA, keys == values), per-head sink,
sliding window over the cache, inverse RoPE on the output, grouped output projection.

Compressed layers (ratio 1 or 2) add, in the same softmax, the compressed entries picked by a
top-k indexer: see `LayerRole` for the FULL / REINDEX / REUSE roles and the module docs of
`Compressor` and `Indexer`; decisions the public sources left open are in docs/model.md.

Legend: T tokens, D hidden, H heads, d head width, S keys per query, G output groups,
Q q-lora rank, O o-lora rank, C compressed entries per slot, K top-k, I index heads,
k index head width.

Sharding view (for the compiler): everything indexed by H or G is head-shardable; the KV latent,
the cache and the window are per token and replicated across heads. Under the official numerics
(`config.Rounding`) every rounding is per token, and per head where it is after the heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv41_compile.deepseek_v41.model.cache import LayerCache
from dsv41_compile.deepseek_v41.model.config import LayerRole, ModelConfig
from dsv41_compile.deepseek_v41.model.layers import (
    Fp32Linear,
    RMSNorm,
    apply_rope,
    rope_inv_freq,
    yarn_inv_freq,
)
from dsv41_compile.deepseek_v41.model.numerics import (
    ACT_BLOCK,
    act_quant_dequant,
    fp4_quant_dequant,
    fp4_rows,
    fp8_rows,
    from_fp4_rows,
    from_fp8_rows,
)
from dsv41_compile.deepseek_v41.model.released import Fp8Linear, linear, weight_of

ATTENTION_BLOCK = 64
"""Keys per block of the official attention kernel's online softmax."""


def sink_attention(q_THd: Tensor, kv_TSd: Tensor, visible_TS: Tensor, sink_H: Tensor) -> Tensor:
    """Softmax attention of each query over its own S keys (values are the keys) plus a sink.

    The sink is a per-head logit with a zero value: it takes probability mass in one softmax with
    the real keys. Logits and the weighted sum are fp32; the result has the query dtype.
    """
    scale = q_THd.shape[-1] ** -0.5
    logits_THS = torch.einsum("thd,tsd->ths", q_THd.float(), kv_TSd.float()) * scale
    logits_THS = logits_THS.masked_fill(~visible_TS[:, None, :], float("-inf"))
    sink_TH1 = sink_H.float()[None, :, None].expand(logits_THS.shape[0], -1, 1)
    probs_THS = torch.softmax(torch.cat((logits_THS, sink_TH1), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("ths,tsd->thd", probs_THS, kv_TSd.float()).to(q_THd.dtype)


def blockwise_sink_attention(
    q_THd: Tensor, kv_TSd: Tensor, visible_TS: Tensor, sink_H: Tensor
) -> Tensor:
    """`sink_attention` as the official kernel rounds it: it walks the keys in blocks of 64 with
    an online softmax and casts the probabilities that multiply the values to bf16, each relative
    to the running max it has then.

    Per query and head, with fp32 logits `s` (invisible keys -inf): `m_b` = the max of -1e30 and
    the logits of blocks 0..b; a key of block b weighs the values by `bf16(exp(s - m_b)) *
    exp(m_b - m_last)` and adds the unrounded `exp(s - m_b) * exp(m_b - m_last)` to the
    denominator, which also takes the sink's `exp(sink - m_last)`. Rounding relative to the
    running max makes the result depend on the key order: the keys must come as the kernel
    walks them (the window oldest first, then the compressed picks by position). The kernel
    rescales its sums block by block; this rescales each block's terms once, the same up to
    fp32 rounding. The result has the query dtype."""
    T, H, d = q_THd.shape
    S = kv_TSd.shape[1]
    blocks = -(-S // ATTENTION_BLOCK)
    logits_THS = torch.einsum("thd,tsd->ths", q_THd.float(), kv_TSd.float()) * d**-0.5
    logits_THS = logits_THS.masked_fill(~visible_TS[:, None, :], float("-inf"))
    logits_THBK = F.pad(logits_THS, (0, blocks * ATTENTION_BLOCK - S), value=float("-inf"))
    logits_THBK = logits_THBK.view(T, H, blocks, ATTENTION_BLOCK)
    running_THB = logits_THBK.amax(-1).clamp(min=-1e30).cummax(-1).values
    probs_THBK = torch.exp(logits_THBK - running_THB[..., None])
    rescale_THB1 = torch.exp(running_THB - running_THB[..., -1:])[..., None]
    denominator_TH = (probs_THBK * rescale_THB1).sum((-2, -1)) + torch.exp(
        sink_H.float() - running_THB[..., -1]
    )
    weights_THS = (probs_THBK.to(torch.bfloat16).float() * rescale_THB1).flatten(-2)[..., :S]
    numerator_THd = torch.einsum("ths,tsd->thd", weights_THS, kv_TSd.float())
    return (numerator_THd / denominator_TH[..., None]).to(q_THd.dtype)


def in_position_order(idx_TK: Tensor, picked_TK: Tensor, n_entries: int) -> tuple[Tensor, Tensor]:
    """The top-k picks by entry position, the unpicked ones after them: the order in which the
    official kernel walks a query's compressed keys (`blockwise_sink_attention`)."""
    # tie-free keys (the unpicked ones after every entry, in their slots' order), so any sort
    # gives this order: graph mode has no stable sort (torchair converts sort, not sort.stable)
    slot_K = torch.arange(idx_TK.shape[1], device=idx_TK.device)
    order_TK = torch.where(picked_TK, idx_TK, n_entries + slot_K).sort(dim=-1).indices
    return idx_TK.gather(1, order_TK), picked_TK.gather(1, order_TK)


def _shifted(x_T: Tensor, shift: int, *, fill: float) -> Tensor:
    """`x` moved by `shift` rows along dim 0 (row t gets row t - shift), with `fill` in the
    rows that have no source. A pad and a slice of constant length: no `T - shift`, and
    T = 0 gives an empty result."""
    n = abs(shift)
    pad = [0, 0] * (x_T.dim() - 1) + ([n, 0] if shift > 0 else [0, n])
    padded = F.pad(x_T, pad, value=fill)
    return padded[:-n] if shift > 0 else padded[n:]


def window_keys(
    ring: Tensor,
    rows: int,
    kv_Td: Tensor,
    cache_slot_T: Tensor,
    positions_T: Tensor,
    start_T: Tensor,
    window: int,
    fp8: bool = False,
) -> tuple[Tensor, Tensor]:
    """The `window` latest KV rows of each token's request, ending at its own position.

    Positions from `start_T` (the first of the token's request in this call) on are this call's
    tokens: a request's tokens are contiguous with consecutive positions, so position q of the
    token at index t (position p) is `kv_Td[t - (p - q)]`. Older positions come from the
    request's ring in the cache (`rows` rows, position q in row `q % rows`; `fp8`: the ring
    holds `numerics.fp8_rows`), read before this call writes it (`write_window`). Returns keys
    [T, W, d] and a visibility mask [T, W] (positions < 0 are not visible).
    """
    back_W = torch.arange(window, device=positions_T.device) - (window - 1)
    key_pos_TW = positions_T[:, None] + back_W
    index_TW = (torch.arange(kv_Td.shape[0], device=positions_T.device)[:, None] + back_W).clamp(
        min=0
    )
    cached_TWd = ring[cache_slot_T[:, None], key_pos_TW.clamp(min=0) % rows]
    if fp8:
        cached_TWd = from_fp8_rows(cached_TWd)
    in_call_TW = key_pos_TW >= start_T[:, None]
    kv_TWd = torch.where(in_call_TW[..., None], kv_Td[index_TW], cached_TWd)
    return kv_TWd, key_pos_TW >= 0


def write_window(
    ring: Tensor, rows: int, kv_Td: Tensor, cache_slot_T: Tensor, positions_T: Tensor
) -> None:
    """This call's KV rows into their requests' rings: position p in row `p % rows`. A row is
    written once: a token whose row the token `rows` places later takes again (the same
    request) writes to the scratch slot instead, so each request keeps its last `rows`
    positions."""
    scratch = ring.shape[0] - 1
    kept_T = _shifted(cache_slot_T, -rows, fill=-1) != cache_slot_T
    slot_T = torch.where(kept_T, cache_slot_T, scratch)
    ring.index_put_((slot_T, torch.where(kept_T, positions_T % rows, 0)), kv_Td)


def sparse_attention_aten(
    q_THd: Tensor,
    kv_Td: Tensor,
    ring: Tensor,
    cache_slot_T: Tensor,
    positions_T: Tensor,
    start_T: Tensor,
    sink_H: Tensor,
    window: int,
    ring_fp8: bool,
    blockwise: bool,
    compressed: Tensor | None = None,
    idx_TK: Tensor | None = None,
    picked_TK: Tensor | None = None,
    compressed_fp4: bool = False,
) -> Tensor:
    """The sink attention of each query over its keys, gathered: its window (`window_keys`:
    this call's rows `kv_Td`, the older ones from the `ring` as read before this call writes
    it; FP8 rows with `ring_fp8`) then, in a compressed layer, its picks `idx_TK` of the
    `compressed` cache (after this call's writes; FP4 rows with `compressed_fp4`), those not
    `picked_TK` invisible; `blockwise`: the official kernel's rounding
    (`blockwise_sink_attention`). The queries' dtype, [T, H, d].

    `dsv41::sparse_attention` is this as one op: the lowerings with fused kernels hand it to
    one that reads the keys where they are (`graph_mode.sparse_attention_sfa`); the others
    compute it as written here (`ModelAdapter.fused_ops`)."""
    keys_TSd, visible_TS = window_keys(
        ring, window, kv_Td, cache_slot_T, positions_T, start_T, window, fp8=ring_fp8
    )
    if compressed is not None:
        assert idx_TK is not None and picked_TK is not None, "a compressed layer's picks"
        ckv_TKd = compressed[cache_slot_T[:, None], idx_TK]
        if compressed_fp4:
            ckv_TKd = from_fp4_rows(ckv_TKd)
        keys_TSd = torch.cat((keys_TSd, ckv_TKd), dim=1)
        visible_TS = torch.cat((visible_TS, picked_TK), dim=1)
    attend = blockwise_sink_attention if blockwise else sink_attention
    return attend(q_THd, keys_TSd, visible_TS, sink_H)


sparse_attention = torch.library.custom_op("dsv41::sparse_attention", mutates_args=())(
    sparse_attention_aten
)


@sparse_attention.register_fake
def _(q_THd, kv_Td, ring, cache_slot_T, positions_T, start_T, sink_H, window, *flags, **picks):
    torch._check(kv_Td.shape[0] == q_THd.shape[0], lambda: "one KV row per query")
    torch._check(sink_H.shape[0] == q_THd.shape[1], lambda: "one sink per head")
    # the ring holds `window` rows: under dynamic=True its size is a symbol of Dynamo's, which
    # this makes the config's number (a layer region would otherwise take it as an operand)
    torch._check(ring.shape[1] == window, lambda: "the ring holds `window` rows")
    return q_THd.new_empty(q_THd.shape)


def compressed_visible(positions_T: Tensor, n_entries: int, ratio: int) -> Tensor:
    """[T, C] mask: entry c (positions `[c*ratio, (c+1)*ratio)`) is visible to the token at
    position t iff `c < (t+1) // ratio`, i.e. once complete; ratio 1 sees its own entry."""
    n_visible_T = torch.div(positions_T + 1, ratio, rounding_mode="floor")
    return torch.arange(n_entries, device=positions_T.device)[None, :] < n_visible_T[:, None]


def top_k(values_TC: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest values along the last dim and their indices, in index order; of equal
    values at the cut, the lower indices. (`torch.topk` breaks ties as its kernel happens to:
    with the relu's exact zeros in the index scores, the choice would change with the number of
    entries, i.e. with the cache's length, and with the batch.) Two topk over keys without
    ties, so any kernel picks the same: the k-th largest value, then the chosen entries by a
    descending count."""
    C = values_TC.shape[-1]
    kth_T1 = torch.topk(values_TC, k, dim=-1).values[..., -1:]
    above_TC, at_TC = values_TC > kth_T1, values_TC == kth_T1
    wanted_T1 = k - above_TC.sum(-1, keepdim=True)
    chosen_TC = above_TC | (at_TC & (at_TC.to(torch.int64).cumsum(-1) <= wanted_T1))
    # C - c for a chosen entry c (distinct, > 0), 0 otherwise: the top k are the chosen ones,
    # the lowest index first
    countdown_C = torch.arange(C, 0, -1, device=values_TC.device, dtype=torch.float32)
    idx_TK = torch.topk(torch.where(chosen_TC, countdown_C, 0.0), k, dim=-1).indices
    return values_TC.gather(-1, idx_TK), idx_TK


def select_topk(scores_TC: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The `min(k, C)` best entries per token (`top_k`): indices [T, K] and a mask [T, K] that
    drops picks whose score is -inf (fewer visible entries than K)."""
    values_TK, idx_TK = top_k(scores_TC, min(k, scores_TC.shape[1]))
    return idx_TK, values_TK > float("-inf")


def candidate_blocks(
    scores_TC: Tensor, positions_T: Tensor, ratio: int, block: int, n_blocks: int
) -> Tensor:
    """[T, C] mask of the candidate entries: the entries are cut into blocks of `block`, each
    block scored by its best entry; the block holding the token's last visible entry is always
    kept; then the `n_blocks` best blocks with a finite score are kept."""
    T, C = scores_TC.shape
    blocks = -(-C // block)
    padded_TC = F.pad(scores_TC, (0, blocks * block - C), value=float("-inf"))
    block_scores_TB = padded_TC.view(T, blocks, block).amax(-1)
    last_entry_T = torch.div(positions_T + 1, ratio, rounding_mode="floor") - 1
    block_ids = torch.arange(blocks, device=scores_TC.device)
    holds_last_TB = (
        block_ids[None, :] == torch.div(last_entry_T, block, rounding_mode="floor")[:, None]
    ) & (last_entry_T >= 0)[:, None]
    block_scores_TB = block_scores_TB.masked_fill(holds_last_TB, float("inf"))
    values, top_TB = top_k(block_scores_TB, min(n_blocks, blocks))
    keep_TB = torch.zeros_like(holds_last_TB).scatter(1, top_TB, values > float("-inf"))
    return keep_TB.repeat_interleave(block, dim=1)[:, :C]


class Compressor(nn.Module):
    """Owned by FULL layers: turns the layer's normalised attention input into compressed
    entries of `ratio` tokens.

    - ratio 1: `ckv_t = norm(wkv x_t)` (no gate, no pooling).
    - ratio 2: `a = wkv x`, `g = wgate x` in fp32; entry c pools tokens 2c and 2c+1 with a
      per-channel softmax of g over the pair: `sum softmax(g) * a`, cast to the activation
      dtype, then `norm`. The ratio-2 weights are fp32.

    `forward` returns, per token, the normalised (unrotated) entry the token completes and a
    mask of the tokens that complete one (ratio 2: odd positions).
    """

    def __init__(self, cfg: ModelConfig, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio
        weight_dtype = torch.float32 if ratio == 2 else cfg.torch_dtype
        self.wkv = nn.Linear(cfg.dim, cfg.head_dim, bias=False, dtype=weight_dtype)
        if ratio == 2:
            self.wgate = nn.Linear(cfg.dim, cfg.head_dim, bias=False, dtype=weight_dtype)
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self, x_TD: Tensor, positions_T: Tensor, cache_slot_T: Tensor, pair_state: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        if self.ratio == 1:
            ckv_Td = F.linear(x_TD.float(), self.wkv.weight.float()).to(x_TD.dtype)
            return self.norm(ckv_Td), torch.ones_like(positions_T, dtype=torch.bool)

        assert pair_state is not None, "a ratio-2 compressor needs its pair_state cache"
        d = self.wkv.out_features
        kv_Td = F.linear(x_TD.float(), self.wkv.weight)
        gate_Td = F.linear(x_TD.float(), self.wgate.weight)
        row_T2d = torch.cat((kv_Td, gate_Td), dim=-1)

        # An odd position closes the pair opened at position p-1: that token is the previous
        # row of the batch if it belongs to the same request, otherwise it came in an earlier
        # call and waits in pair_state. Shifts by one row pad the other end (no roll, no
        # `T - 1`): one graph serves every T, 0 included.
        prev_slot_T = _shifted(cache_slot_T, 1, fill=-1)  # -1: no previous row
        prev_in_batch_T = prev_slot_T == cache_slot_T
        prev_row_T2d = _shifted(row_T2d, 1, fill=0)
        opener_T2d = torch.where(prev_in_batch_T[:, None], prev_row_T2d, pair_state[cache_slot_T])
        closes_T = positions_T % 2 == 1

        kv_pair = torch.stack((opener_T2d[:, :d], kv_Td))
        gate_pair = torch.stack((opener_T2d[:, d:], gate_Td))
        pooled_Td = (torch.softmax(gate_pair, dim=0) * kv_pair).sum(0)

        # Keep the opener of a pair left open at the end of this call (its request's last row);
        # every other row writes to the scratch slot.
        last_of_request_T = _shifted(cache_slot_T, -1, fill=-1) != cache_slot_T
        left_open_T = ~closes_T & last_of_request_T
        scratch = pair_state.shape[0] - 1
        pair_state.index_put_((torch.where(left_open_T, cache_slot_T, scratch),), row_T2d)
        return self.norm(pooled_Td.to(x_TD.dtype)), closes_T


class Indexer(nn.Module):
    """Scores compressed entries for top-k selection (FULL and REINDEX layers).

    `score[t, c] = sum_i relu(q[t, i] . k_c) * w[t, i]` with index queries `q = wq_b(qr)`
    (rotated at the token's position), index keys `k_c = rope(k_norm(wk ckv_c), c*ratio)`
    (made by the FULL layer that owns the compressor; `wk` and `k_norm` exist only there) and
    per-head weights `w = weights_proj(x) * k^-0.5 * I^-0.5`.

    Official numerics (`config.Rounding`): `qr` enters `wq_b` FP8-quantised (the caller's);
    queries and keys are FP4 with an e8m0 scale per 32 after RoPE; the scores are bf16.
    """

    def __init__(self, cfg: ModelConfig, *, owns_keys: bool) -> None:
        super().__init__()
        dtype = cfg.torch_dtype
        self.rounding = cfg.rounding
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        released = cfg.weight_format == "released"
        self.wq_b = linear(
            cfg.q_lora_rank, self.n_heads * self.head_dim, released=released, dtype=dtype
        )
        self.weights_proj = nn.Linear(cfg.dim, self.n_heads, bias=False, dtype=dtype)
        if owns_keys:
            self.wk = nn.Linear(cfg.head_dim, self.head_dim, bias=False, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def keys(self, ckv_Td: Tensor, entry_pos_T: Tensor, inv_freq: Tensor) -> Tensor:
        keys_Tk = F.linear(ckv_Td.float(), self.wk.weight.float()).to(ckv_Td.dtype)
        keys_Tk = apply_rope(self.k_norm(keys_Tk), entry_pos_T, inv_freq)
        if self.rounding.index_k:
            keys_Tk = fp4_quant_dequant(keys_Tk, ACT_BLOCK, "e8m0")
        return keys_Tk

    def forward(
        self,
        x_TD: Tensor,
        q_TQ: Tensor,
        positions_T: Tensor,
        inv_freq: Tensor,
        keys_TCk: Tensor,
        visible_TC: Tensor,
    ) -> Tensor:
        T = x_TD.shape[0]
        q_TIk = apply_rope(
            self.wq_b(q_TQ).view(T, self.n_heads, self.head_dim), positions_T, inv_freq
        )
        if self.rounding.index_q:
            q_TIk = fp4_quant_dequant(q_TIk, ACT_BLOCK, "e8m0")
        weights_TI = self.weights_proj(x_TD)
        scale = (self.head_dim * self.n_heads) ** -0.5
        dots_TIC = torch.einsum("tik,tck->tic", q_TIk.float(), keys_TCk.float())
        if self.rounding.index_scores:  # bf16 weights (the official numerics' dtype); each
            # step rounds to bf16: the dot products, their weighting, the sum over heads
            relu_TIC = dots_TIC.to(torch.bfloat16).relu()
            scores_TC = (relu_TIC * (weights_TI * scale)[..., None]).sum(1)
        else:
            scores_TC = torch.einsum("tic,ti->tc", dots_TIC.relu(), weights_TI.float() * scale)
        return scores_TC.masked_fill(~visible_TC, float("-inf"))


def rope_frequencies(cfg: ModelConfig, role: LayerRole) -> Tensor:
    """The RoPE inverse frequencies of a layer: plain in window-only layers, YaRN-scaled with
    the compressed layers' theta elsewhere."""
    if role.mode == "swa":
        return rope_inv_freq(cfg.rope_head_dim, cfg.rope_theta)
    return yarn_inv_freq(
        cfg.rope_head_dim,
        cfg.compress_rope_theta,
        factor=cfg.rope_factor,
        original_max_pos=cfg.original_max_position_embeddings,
        beta_fast=cfg.beta_fast,
        beta_slow=cfg.beta_slow,
    )


class OutputProjection(Fp32Linear):
    """`wo_b`, in fp32 (`Fp32Linear`); under the official numerics (`Rounding.gemm_inputs`) it
    FP8-quantises its own input first, as the official FP8 GEMM quantises what it multiplies.
    The quantisation is inside the module so that a layout placing what enters `wo_b` places
    it before the quantisation: moved to its tokens' ranks (the exit all-to-all), each token's
    row is quantised whole; kept as the ranks' output groups (row-parallel `wo_b`), each rank
    quantises its own groups, whose width must then be a multiple of the 32-value block."""

    def __init__(self, in_features: int, out_features: int, *, fp8_input: bool, dtype) -> None:
        super().__init__(in_features, out_features, bias=False, dtype=dtype)
        self.fp8_input = fp8_input

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(act_quant_dequant(x) if self.fp8_input else x)


class Attention(nn.Module):
    """MQA with sink over the sliding window and, in compressed layers, the top-k compressed
    entries, for one layer. Returns the output projection in fp32 (bf16 under the official
    numerics, as the official FP8 GEMM returns it).

    Official numerics (`config.Rounding`, each step on its own): the inputs of `wq_a` / `wkv`,
    of `wq_b` / the indexer's `wq_b` and of `wo_b` are FP8-quantised (not those of `wo_a`, the
    compressor or the indexer's `wk` / `weights_proj`); the window KV is FP8 after RoPE, a
    compressed entry FP4 (e4m3 scale per 16) after RoPE, and the caches hold them so; the
    probabilities are bf16 (`blockwise_sink_attention`, compressed picks in position order).
    """

    rope_inv_freq: Tensor  # a buffer

    def __init__(self, cfg: ModelConfig, layer_id: int, role: LayerRole) -> None:
        super().__init__()
        dtype = cfg.torch_dtype
        self.layer_id, self.role = layer_id, role
        self.rounding = cfg.rounding
        self.n_heads, self.head_dim, self.window = cfg.n_heads, cfg.head_dim, cfg.window_size
        self.o_groups, self.o_lora_rank = cfg.o_groups, cfg.o_lora_rank
        self.index_topk = cfg.index_topk
        self.candidate_block_size = cfg.candidate_block_size
        self.candidate_topk_blocks = cfg.candidate_topk_blocks
        released = cfg.weight_format == "released"
        self.wq_a = linear(cfg.dim, cfg.q_lora_rank, released=released, dtype=dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = linear(
            cfg.q_lora_rank, cfg.n_heads * cfg.head_dim, released=released, dtype=dtype
        )
        self.wkv = linear(cfg.dim, cfg.head_dim, released=released, dtype=dtype)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.attn_sink = nn.Parameter(torch.empty(cfg.n_heads, dtype=torch.float32))
        group_width = cfg.n_heads // cfg.o_groups * cfg.head_dim
        self.wo_a = linear(
            group_width, cfg.o_groups * cfg.o_lora_rank, released=released, dtype=dtype
        )
        out_args = (cfg.o_groups * cfg.o_lora_rank, cfg.dim)
        fp8_input = self.rounding.gemm_inputs
        self.wo_b = (
            Fp8Linear(*out_args, fp32=True, fp8_input=fp8_input)
            if released
            else OutputProjection(*out_args, fp8_input=fp8_input, dtype=dtype)
        )
        if role.mode == "full":
            self.compressor = Compressor(cfg, role.ratio)
        if role.mode in ("full", "reindex"):
            self.indexer = Indexer(cfg, owns_keys=role.mode == "full")
        self.register_buffer("rope_inv_freq", rope_frequencies(cfg, role), persistent=False)

    def forward(
        self,
        x_TD: Tensor,
        positions_T: Tensor,
        cache_slot_T: Tensor,
        kv: LayerCache,
        topk: tuple[Tensor, Tensor] | None = None,
        candidates_TC: Tensor | None = None,
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """The output projection [T, D] fp32 and what this layer makes for later layers of the
        same forward: an index source's top-k `(idx_TK, picked_TK)`, and the candidate source's
        candidate mask after them (empty otherwise). A REUSE layer takes its top-k source's
        `topk`, a candidate-filtered index layer the candidate source's `candidates_TC`."""
        rounding = self.rounding
        gemm_x_TD = act_quant_dequant(x_TD) if rounding.gemm_inputs else x_TD
        gemm_q_TQ, q_THd = self.queries(gemm_x_TD, positions_T)
        kv_Td, kv_rows_Td = self.window_kv(gemm_x_TD, positions_T)

        # Read, then write: a token's window takes this call's rows from kv_Td and the older
        # ones from the ring, which this call then overwrites (after the attention).
        # The ring's length from the config, not from the cache: under dynamic=True Dynamo
        # makes the cache's sizes (and its max_len) symbols, which the token count's
        # generalisation must not meet in a pad.
        ring, rows, scratch = kv.window, self.window, kv.num_slots
        start_T = torch.where(
            cache_slot_T == scratch,
            positions_T,  # a padding row: nothing of it is cached
            kv.lengths[cache_slot_T.clamp(max=kv.num_slots - 1)],
        )
        made: tuple[Tensor, ...] = ()
        ckv_cache = idx_TK = picked_TK = None
        if self.role.mode != "swa":
            ckv_cache, idx_TK, picked_TK, made = self.compressed_keys(
                x_TD, gemm_q_TQ, positions_T, cache_slot_T, kv, topk, candidates_TC
            )
        # one op (`sparse_attention`): a lowering with a fused kernel reads the keys where they
        # are; the others compute it as written (`sparse_attention_aten`)
        o_THd = torch.ops.dsv41.sparse_attention(
            q_THd,
            kv_Td,
            ring,
            cache_slot_T,
            positions_T,
            start_T,
            self.attn_sink,
            rows,
            rounding.window_kv,
            rounding.probabilities,
            ckv_cache,
            idx_TK,
            picked_TK,
            rounding.compressed_kv,
        )
        write_window(ring, rows, kv_rows_Td, cache_slot_T, positions_T)
        return self.project(o_THd, positions_T), made

    def queries(self, gemm_x_TD: Tensor, positions_T: Tensor) -> tuple[Tensor, Tensor]:
        """The input of `wq_b` (FP8-quantised under the official numerics) and the rotated
        queries [T, H, d], from the attention input as the FP8 GEMMs take it."""
        T, H, d = gemm_x_TD.shape[0], self.n_heads, self.head_dim
        q_TQ = self.q_norm(self.wq_a(gemm_x_TD))
        gemm_q_TQ = act_quant_dequant(q_TQ) if self.rounding.gemm_inputs else q_TQ
        q_THd = apply_rope(self.wq_b(gemm_q_TQ).view(T, H, d), positions_T, self.rope_inv_freq)
        return gemm_q_TQ, q_THd

    def window_kv(self, gemm_x_TD: Tensor, positions_T: Tensor) -> tuple[Tensor, Tensor]:
        """The rotated KV latent [T, d] as attention reads it, and the rows the window ring
        holds (`numerics.fp8_rows` under the official numerics, the values otherwise)."""
        kv_Td = apply_rope(self.kv_norm(self.wkv(gemm_x_TD)), positions_T, self.rope_inv_freq)
        if not self.rounding.window_kv:
            return kv_Td, kv_Td
        kv_rows_Td = fp8_rows(kv_Td)
        return from_fp8_rows(kv_rows_Td), kv_rows_Td

    def attend(
        self, q_THd: Tensor, keys_TSd: Tensor, visible_TS: Tensor, positions_T: Tensor
    ) -> Tensor:
        """The sink attention of the queries over their keys, un-rotated, through `wo_a` and
        `wo_b`: the layer's output [T, D]."""
        attend = blockwise_sink_attention if self.rounding.probabilities else sink_attention
        return self.project(attend(q_THd, keys_TSd, visible_TS, self.attn_sink), positions_T)

    def project(self, o_THd: Tensor, positions_T: Tensor) -> Tensor:
        """The attention's output [T, H, d], un-rotated, through `wo_a` and `wo_b`: the layer's
        output [T, D]."""
        T, H, d, G = o_THd.shape[0], self.n_heads, self.head_dim, self.o_groups
        rounding = self.rounding
        o_THd = apply_rope(o_THd, positions_T, self.rope_inv_freq, inverse=True)

        wo_a_GOK = weight_of(self.wo_a, o_THd.dtype).view(G, self.o_lora_rank, -1)
        z_TGO = torch.einsum("tgk,gok->tgo", o_THd.reshape(T, G, H // G * d), wo_a_GOK)
        z_TF = z_TGO.flatten(1)
        # fp32 output: under tensor parallelism either the partial sum that is reduce-scattered,
        # or (the exit all-to-all) each token's whole projection on the rank that holds it. The
        # official numerics round the whole sum to bf16.
        out_TD = self.wo_b(z_TF)
        if rounding.wo_b_output:
            out_TD = out_TD.to(torch.bfloat16)
        return out_TD

    def compressed_keys(
        self,
        x_TD: Tensor,
        q_TQ: Tensor,
        positions_T: Tensor,
        cache_slot_T: Tensor,
        kv: LayerCache,
        topk: tuple[Tensor, Tensor] | None,
        candidates_TC: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, ...]]:
        """The compressed cache after this call's writes, the entries each token attends to in
        it (`idx_TK`, which are real: `picked_TK`), and what it makes for later layers
        (`forward`). `q_TQ` is the input of the indexer's `wq_b`."""
        role, inv_freq, rounding = self.role, self.rope_inv_freq, self.rounding
        ckv_cache, index_k_cache = kv.compressed, kv.index_k
        assert ckv_cache is not None and index_k_cache is not None, "a compressed layer's cache"

        if role.mode == "full":
            ckv_Td, completes_T = self.compressor(x_TD, positions_T, cache_slot_T, kv.pair_state)
            entry_T = torch.div(positions_T, role.ratio, rounding_mode="floor")
            entry_pos_T = entry_T * role.ratio  # compressed rope at the group's first position
            slot_T = torch.where(completes_T, cache_slot_T, kv.num_slots)
            rotated_Td = apply_rope(ckv_Td, entry_pos_T, inv_freq)
            if rounding.compressed_kv:
                rotated_Td = fp4_rows(rotated_Td)
            ckv_cache.index_put_((slot_T, entry_T), rotated_Td)
            index_k_cache.index_put_(
                (slot_T, entry_T), self.indexer.keys(ckv_Td, entry_pos_T, inv_freq)
            )

        made: tuple[Tensor, ...] = ()
        if role.mode == "reuse":
            assert topk is not None, "a REUSE layer takes its top-k source's top-k"
            idx_TK, picked_TK = topk
        else:
            visible_TC = compressed_visible(positions_T, ckv_cache.shape[1], role.ratio)
            scores_TC = self.indexer(
                x_TD, q_TQ, positions_T, inv_freq, index_k_cache[cache_slot_T], visible_TC
            )
            if role.makes_candidates:
                candidates_TC = candidate_blocks(
                    scores_TC,
                    positions_T,
                    role.ratio,
                    self.candidate_block_size,
                    self.candidate_topk_blocks,
                )
            if role.candidate_filtered:
                assert candidates_TC is not None, "candidate source must run before its users"
                scores_TC = scores_TC.masked_fill(~candidates_TC, float("-inf"))
            idx_TK, picked_TK = select_topk(scores_TC, self.index_topk)
            if rounding.probabilities:
                idx_TK, picked_TK = in_position_order(idx_TK, picked_TK, scores_TC.shape[1])
            if role.makes_candidates:
                assert candidates_TC is not None, "made above"
                made = (idx_TK, picked_TK, candidates_TC)
            else:
                made = (idx_TK, picked_TK)
        return ckv_cache, idx_TK, picked_TK, made
