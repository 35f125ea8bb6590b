"""The model configurations the tests compile: the presets, shorter to trace.

A compile traces every op of the model with Dynamo and AOTAutograd, and a multi-rank test does
it on every rank. The cost grows with the layer count and with the mHC mixing's Sinkhorn
iterations, an unrolled loop of the same few pointwise ops (20 iterations in every preset).
Compiler tests are about the ops and the boundaries between them, not about a layer count or
the mixing's convergence, so they compile with these overrides of `ModelConfig.from_name`
(pairs, hashable for `deepseek_v41.testing.cases.CaseSpec`); the single-device model's own tests keep the
presets as they are.

    ModelConfig.from_name("tiny", **dict(EVERY_MODE_5 + SINKHORN_3))
    compile_config()                     # tiny-swa with 3 Sinkhorn iterations
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dsv41_compile.deepseek_v41.model import ModelConfig
from dsv41_compile.devices import DEVICES, Device

__all__ = [
    "AS_RELEASED",
    "ENGRAM_0",
    "EVERY_MODE_5",
    "EVERY_MODE_6",
    "ONE_LAYER",
    "SEED_LAYOUT",
    "SINKHORN_3",
    "SLOW_HBM",
    "SLOW_LINK",
    "WIDE",
    "compile_config",
]

SEED_LAYOUT: dict[str, Any] = {
    "layout": "sp",
    "attn_entry": "input",
    "attn_exit": "reduce_scatter",
    "ep_rows": "per_assignment",
    "head": "replicated",
}
"""The backend options of the seed's layout exactly (docs/benchmarks.md, "The three
configurations"): the normed input gathered, wo_b's fp32 partial reduce-scattered, one EP row
per (token, expert) assignment, the head whole on every rank. The tools compare the other
layouts against it."""

SINKHORN_3: tuple[tuple[str, Any], ...] = (("hc_sinkhorn_iters", 3),)
"""3 Sinkhorn iterations instead of 20: the same code, about a third shorter to trace."""

EVERY_MODE_5: tuple[tuple[str, Any], ...] = (
    ("n_layers", 5),
    ("compress_ratios", (0, 2, 1, 1, 1)),
    ("kv_source_layer_ids", (1, 2)),
    ("index_source_layer_ids", (1, 2, 4)),
    ("candidate_source_layer_id", 2),
)
"""tiny cut to 5 layers that keep every attention mode: window-only, ratio-2 FULL (a KV
source), ratio-1 FULL making candidates, REUSE, REINDEX filtered by candidates (tiny's 8 add a
second window-only layer and two more REUSE)."""

EVERY_MODE_6: tuple[tuple[str, Any], ...] = (
    *EVERY_MODE_5,
    ("n_layers", 6),
    ("compress_ratios", (0, 2, 1, 1, 1, 1)),
)
"""EVERY_MODE_5 and a sixth layer, a second ratio-1 REUSE (after the REINDEX layer, whose top-k
it reuses): a layer kind met twice, so Dynamo traces it once and calls the subgraph at layers 3
and 5 (`regions` copies it in at both)."""

ONE_LAYER: tuple[tuple[str, Any], ...] = (("n_layers", 1),)
"""One decoder layer (of tiny-swa: window-only); the boundary between layers is not in it."""

ENGRAM_0: tuple[tuple[str, Any], ...] = (
    ("engram_layer_ids", (0,)),
    ("engram_num_embeddings", (384,)),
)
"""An Engram layer before layer 0 (tiny's tables: 6 columns of 32-wide rows), for the
window-only configurations, which have none (tiny has one before layer 1)."""

AS_RELEASED: tuple[tuple[str, Any], ...] = (
    ("dtype", "bfloat16"),
    ("numerics", "official"),
    ("weight_format", "released"),
    ("o_lora_rank", 32),
    ("index_head_dim", 32),
)
"""tiny as released: bf16, the official numerics, its FP8 linears and FP4 routed experts held as
released; `wo_a`'s 4 x 32 output rows split over tp=4 in whole 32 x 32 blocks of its scales
(tiny's 4 x 16 would not be), the indexer quantised in whole blocks of 32 (tiny's 16 would not
be)."""

WIDE: tuple[tuple[str, Any], ...] = (("dim", 128),)
"""tiny at twice its hidden width: attention's q and kv latents (32 + 32) are then narrower
than its input (128), so `attn_entry="auto"` gathers them (`spmd.entry_cut`); at tiny's own 64
they tie and the input is gathered, as in the seed's layout."""


def compile_config(
    preset: str = "tiny-swa", *overrides: tuple[tuple[str, Any], ...]
) -> ModelConfig:
    """`preset` with 3 Sinkhorn iterations and `overrides` (pairs) on top."""
    return ModelConfig.from_name(
        preset, **dict(SINKHORN_3), **dict(p for o in overrides for p in o)
    )


SLOW_HBM = Device(
    name="slow-hbm",
    hbm_bytes=64e9,
    hbm_bytes_per_s=1e8,
    flops={"bf16": 1e12},
    link_bytes_per_s=50e9,
    node_link_bytes_per_s=25e9,
)
"""A device of a user's own (the `device` option) whose memory is so slow that reading
tiny-swa's 131 kB fp32 head (1.3 ms) costs more than gathering its logits (a 10 us latency):
the head is vocab-sharded where the 950DT keeps it whole."""

SLOW_LINK = dataclasses.replace(
    DEVICES["950dt"], name="slow-link", link_bytes_per_s=1e8, node_link_bytes_per_s=1e8
)
"""The 950DT with a link so slow (100 MB/s) that, at a prefill's 4096 rows per step, the
padded EP dispatch's worst-case rows cost more than the exact one's count exchange and host
read: `ep_dispatch="auto"` is exact here and padded on the 950DT."""
