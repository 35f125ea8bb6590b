"""The inference cache: a structure of tensors that `DeepseekV41.forward` mutates in place.

A slot is one request. Every layer keeps the rotated, normalised KV latent of the last
`window_size` positions the slot has seen, in a ring (`window_kv[layer][slot, position %
window_size]`): attention reads no older one. Each kv-source layer (one that owns a compressor) also keeps, per compressed entry c
(covering positions `[c*ratio, (c+1)*ratio)`), the rotated compressed KV and the index key; a
ratio-2 source keeps the fp32 projections of an incomplete pair's first token
(`pair_state`), so a pair split across two calls pools exactly as in one prefill.

Under `ModelConfig.numerics="official"` the window KV is held as FP8 and the compressed KV as
FP4, a row's codes followed by its scales (`numerics.fp8_rows`, `numerics.fp4_rows`): the
official numerics in the official formats' bytes.

All tensors have one extra slot at index `num_slots`, the scratch slot: padding rows
(`slots == -1`) and writes that must not land (an incomplete pair's entry) go there, so no row of
a real request is touched and no write needs a data-dependent shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from torch import Tensor


class LayerCache(NamedTuple):
    """The part of the cache one layer reads and writes (`KVCache.layer`): a layer is handed
    these tensors and nothing else of the cache, so that every layer of a kind is the same
    function of its inputs (what lets `torch.compile` trace a kind once, docs/model.md)."""

    num_slots: int
    lengths: Tensor
    window: Tensor
    compressed: Tensor | None
    """The kv source's compressed KV (None in a window-only layer); also `index_k`."""
    index_k: Tensor | None
    pair_state: Tensor | None
    """Only in a ratio-2 kv-source layer."""


@dataclass
class KVCache:
    num_slots: int
    """Requests the cache can hold (slot ids 0 .. num_slots-1)."""
    max_len: int
    """Positions per slot (0 .. max_len-1)."""
    lengths: Tensor
    """int64 [num_slots]: tokens held per slot (the next position a request must continue at)."""
    window_kv: list[Tensor]
    """Per layer, [num_slots + 1, window_size, head_dim]: the KV latent of the last
    `window_size` positions, position p in row p % window_size. Official numerics: uint8
    [num_slots + 1, window_size, head_dim + head_dim / 32], FP8 codes then e8m0 scales."""
    compressed_kv: dict[int, Tensor]
    """Per kv-source layer, [num_slots + 1, ceil(max_len / ratio), head_dim]. Official numerics:
    uint8 [..., head_dim / 2 + head_dim / 16], packed e2m1 pairs then e4m3 scales."""
    index_k: dict[int, Tensor]
    """Per kv-source layer, [num_slots + 1, ceil(max_len / ratio), index_head_dim]."""
    pair_state: dict[int, Tensor]
    """Per ratio-2 kv-source layer, fp32 [num_slots + 1, 2 * head_dim]: the kv and gate
    projections of a request's last token when it opened a pair that is not yet complete."""
    ngram: list[Tensor] = field(default_factory=list)
    """With Engram layers, `engram_max_ngram_size - 1` int64 [num_slots + 1]: entry j holds each
    request's compressed id j + 1 positions before its next token (`model.engram`); the n-grams
    of its next tokens reach back into them. (Separate tensors rather than one with a width of
    J: under `dynamic=True`, Dynamo would give that width a symbol it may share with T.)"""

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    def layer(self, layer_id: int, kv_source: int) -> LayerCache:
        """What layer `layer_id`, reading the compressed entries of `kv_source` (-1: none),
        reads and writes."""
        return LayerCache(
            self.num_slots,
            self.lengths,
            self.window_kv[layer_id],
            self.compressed_kv.get(kv_source),
            self.index_k.get(kv_source),
            self.pair_state.get(layer_id),
        )

    def tensors(self) -> list[Tensor]:
        """Every tensor of the cache, in a fixed order (for comparing two caches)."""
        out = [self.lengths, *self.window_kv]
        for table in (self.compressed_kv, self.index_k, self.pair_state):
            out += [table[k] for k in sorted(table)]
        return [*out, *self.ngram]


@dataclass
class SavedRows:
    """Rows of a cache as they were before a call (`DeepseekV41.save_rows`), each with the
    position whose write would change it: `DeepseekV41.cut_cache` puts back the rows written
    by positions the cache is cut before."""

    slot: int
    first: int
    """The call's first position for the slot (what the cache held before it)."""
    rows: list[tuple[Tensor, tuple[int, list[int]], Tensor, list[int]]] = field(
        default_factory=list
    )
    """(tensor, (slot, row indices), the rows' values, the position that writes each row)."""
