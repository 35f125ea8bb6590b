"""Engram: an n-gram memory added to the residual streams before some layers (V4.1's
`engram_layer_ids`; flash: layers 1 and 14).

Per token, the n-grams that end at it -- its compressed id and those of up to
`engram_max_ngram_size - 1` tokens before it in the same request, across calls -- are hashed
into one row of each of the layer's table columns (`EngramHash`, with the constants of
`model.ngram`). The rows (FP8, an e8m0 scale per 32; the table is never dequantised whole) are
looked up and concatenated, projected by `wkv` into one key per residual stream and one value,
and each stream gets the value times its own gate: a sigmoid of the signed square root of the
stream's normalised dot product with its key (`Engram`). The layer's block then runs on the
changed streams; its attention input still mixes them with the `pre` the previous layer made.

Legend: T tokens, N streams, D hidden, C table columns, W row width, K n-gram window
(`engram_max_ngram_size`), L Engram layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv41_compile.deepseek_v41.model.config import ModelConfig
from dsv41_compile.deepseek_v41.model.layers import StaticFloat
from dsv41_compile.deepseek_v41.model.ngram import column_offsets, hash_multipliers
from dsv41_compile.deepseek_v41.model.numerics import act_quant_dequant
from dsv41_compile.deepseek_v41.model.ops import engram_lookup
from dsv41_compile.deepseek_v41.model.released import linear

__all__ = ["Engram", "EngramHash", "EngramTable", "engram_gate", "ngram_window"]


class EngramTable(nn.Module):
    """One layer's table as released: `weight` float8_e4m3fn [rows, W], `scale`
    float8_e8m0fnu [rows, W/32]. Rows are dequantised when they are looked up."""

    def __init__(self, rows: int, width: int, columns: tuple[int, ...]) -> None:
        super().__init__()
        self.columns = list(columns)
        """The column bounds: column c's rows are `[columns[c], columns[c + 1])`."""
        self.weight = nn.Parameter(
            torch.empty(rows, width, dtype=torch.float8_e4m3fn), requires_grad=False
        )
        self.scale = nn.Parameter(
            torch.empty(rows, width // 32, dtype=torch.float8_e8m0fnu), requires_grad=False
        )

    def forward(self, rows: Tensor, dtype: torch.dtype) -> Tensor:
        return engram_lookup(self.weight, self.scale, rows, self.columns, dtype)


class Engram(nn.Module):
    """`x_TND -> x_TND + gate_TN * value_TD` for one Engram layer: rows [T, C] of its table
    -> [T, C*W] -> `wkv` -> N keys and one value (D each) -> per stream i

        dot = sum_D(h_i * (q_weight * k_weight)_i * key_i) * rsqrt(mean_D h_i^2 + eps)
              * rsqrt(mean_D key_i^2 + eps) / sqrt(D)
        gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))

    in fp32 (h = x.float(), eps = `rms_norm_eps`), the result cast back to x's dtype."""

    def __init__(self, cfg: ModelConfig, primes: tuple[int, ...]) -> None:
        super().__init__()
        self.dim, self.streams = cfg.dim, cfg.hc_mult
        columns = (*column_offsets(primes), sum(primes))
        self.embed = EngramTable(sum(primes), cfg.engram_head_dim, columns)
        width = cfg.engram_columns * cfg.engram_head_dim
        self.wkv = linear(
            width,
            cfg.dim * (cfg.hc_mult + 1),
            released=cfg.weight_format == "released",
            dtype=cfg.torch_dtype,
        )
        self.dtype = cfg.torch_dtype  # what the looked-up rows are decoded to
        self.q_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.dim, dtype=cfg.torch_dtype))
        self.k_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.dim, dtype=cfg.torch_dtype))
        self.eps = StaticFloat(cfg.rms_norm_eps)
        self.fp8_input = cfg.rounding.gemm_inputs  # wkv is an FP8 GEMM
        self.clamp = StaticFloat(1e-6)

    def forward(self, x_TND: Tensor, rows_TC: Tensor) -> Tensor:
        rows_TW = self.embed(rows_TC, self.dtype).flatten(1)
        kv = self.wkv(act_quant_dequant(rows_TW) if self.fp8_input else rows_TW)
        key_TN_D, value_TD = kv.split([self.streams * self.dim, self.dim], dim=-1)
        key_TND = key_TN_D.float().unflatten(-1, (self.streams, self.dim))
        weight_ND = self.q_weight.float() * self.k_weight.float()
        h_TND = x_TND.float()
        gate_TN = engram_gate(h_TND, key_TND, weight_ND, self.eps, self.clamp)
        return (h_TND + gate_TN[..., None] * value_TD.float()[:, None, :]).to(x_TND.dtype)


def engram_gate(
    h_TND: Tensor, key_TND: Tensor, weight_ND: Tensor, eps: float, clamp: float
) -> Tensor:
    """`[T, N]`: per token and stream, `sigmoid(sign(dot) * sqrt(max(|dot|, clamp)))` of the
    normalised product `dot = sum_D(h * weight * key) * rsqrt(mean_D h^2 + eps)
    * rsqrt(mean_D key^2 + eps) / sqrt(D)` (fp32 inputs; each stream normalised on its own)."""
    rstd_TN = torch.rsqrt(h_TND.square().mean(-1) + eps) * torch.rsqrt(
        key_TND.square().mean(-1) + eps
    )
    dot_TN = (h_TND * weight_ND * key_TND).sum(-1) * rstd_TN * h_TND.shape[-1] ** -0.5
    return torch.sigmoid(torch.copysign(dot_TN.abs().clamp_min(clamp).sqrt(), dot_TN))


def ngram_window(
    compressed_T: Tensor,
    positions_T: Tensor,
    slots_T: Tensor,
    history: list[Tensor],
    pad: Tensor | int,
) -> Tensor:
    """`[T, K]`: column k is the compressed id of the token k positions before token t in its
    request (k = 0: t itself), K = J + 1 for the J tensors `[T]` of `history` (the request's id
    j + 1 positions before this batch, gathered per token). From this batch where the request's
    earlier tokens are in it (contiguous, positions one apart), else from the history; `pad`
    where the n-gram would reach before position 0."""
    J = len(history)
    columns, same = [compressed_T], []
    for k in range(1, J + 1):
        # shifted k rows down; `[:-k]`, not `[:T]`: a trace at a static T keeps no T in a slice
        earlier = [F.pad(v, (k, 0), value=-1)[:-k] for v in (compressed_T, slots_T, positions_T)]
        same.append((earlier[1] == slots_T) & (earlier[2] == positions_T - k))
        columns.append(earlier[0])
    in_batch_T = torch.stack(same, 1).sum(1)  # earlier tokens of the request in this batch
    history_TJ = torch.stack(history, 1)
    for k in range(1, J + 1):
        j = (k - in_batch_T - 1).clamp(0, J - 1)  # how far back into the history
        from_history = history_TJ.gather(1, j[:, None]).squeeze(1)
        value = torch.where(same[k - 1], columns[k], from_history)
        columns[k] = torch.where(positions_T >= k, value, pad)
    return torch.stack(columns, 1)


class EngramHash(nn.Module):
    """Token ids -> the rows each Engram layer looks up, and the n-gram history of each request
    kept in the cache (`KVCache.ngram`).

    `token_map` (int64 [vocab]) is the compressed token map: a parameter, read from the
    tokenizer with the checkpoint (`model.ngram.compressed_token_map`); a model built from a
    config maps id i to `i % engram_compressed_vocab_size`. The multipliers, primes and column
    offsets are buffers computed from the config."""

    multipliers_LK: Tensor
    primes_LOH: Tensor
    offsets_LC: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.pad_id = cfg.engram_pad_id
        self.token_map = nn.Parameter(
            torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size, requires_grad=False
        )
        primes = cfg.engram_primes
        multipliers = hash_multipliers(
            cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_compressed_vocab_size
        )
        heads = cfg.engram_n_heads
        by_order = [[p[i : i + heads] for i in range(0, len(p), heads)] for p in primes]
        self.register_buffer("multipliers_LK", torch.tensor(multipliers), persistent=False)
        self.register_buffer("primes_LOH", torch.tensor(by_order), persistent=False)
        self.register_buffer(
            "offsets_LC", torch.tensor([column_offsets(p) for p in primes]), persistent=False
        )

    def forward(
        self,
        input_ids: Tensor,
        positions_T: Tensor,
        slots_T: Tensor,
        cache_slot_T: Tensor,
        history: list[Tensor],
    ) -> Tensor:
        """`[L, T, C]`: each Engram layer's table rows per token (column offsets included).
        Moves the history of every request of the batch on (`history`: J tensors [slots + 1],
        the request's id 1 .. J positions before its next token, written in place at the
        request's last token; every other row, padding rows too, writes the scratch slot, the
        last)."""
        compressed_T = self.token_map[input_ids]
        pad = self.token_map[self.pad_id]
        gathered = [h[cache_slot_T] for h in history]
        window_TK = ngram_window(compressed_T, positions_T, slots_T, gathered, pad)
        nxt = [F.pad(v, (0, 1), value=-1)[1:] for v in (slots_T, positions_T)]
        last_T = (nxt[0] != slots_T) | (nxt[1] != positions_T + 1)
        for j, h in enumerate(history):
            dest_T = torch.where(last_T, cache_slot_T, h.shape[0] - 1)
            h.index_put_((dest_T,), window_TK[:, j])
        return self.rows(window_TK)

    def rows(self, window_TK: Tensor) -> Tensor:
        """`[L, T, C]` table rows of the n-gram windows: per layer, `r = id_0 * m_0`, then for
        each order n = 2 .. K `r ^= id_{n-1} * m_{n-1}` and column `(n-2)*H + h` gets
        `r % prime + offset` (int64 throughout: no product overflows)."""
        products_TLK = window_TK[:, None, :] * self.multipliers_LK
        rolling_TL = products_TLK[..., 0]
        hashes = []
        for i in range(1, window_TK.shape[1]):
            rolling_TL = torch.bitwise_xor(rolling_TL, products_TLK[..., i])
            hashes.append(rolling_TL[..., None] % self.primes_LOH[:, i - 1])
        return (torch.cat(hashes, -1) + self.offsets_LC).transpose(0, 1)
