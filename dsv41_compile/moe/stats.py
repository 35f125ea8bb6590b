"""What an expert-parallel MoE layer moves: the per-layer description (`EpLayer`) that turns
its statistics output into bytes, and the sizes the accounting shares."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from dsv41_compile.core.context import CompileContext

__all__ = [
    "ALL_TO_ALLS",
    "COUNT_BYTES",
    "EP_ROWS",
    "ROUTE_ROW_BYTES",
    "EpLayer",
    "EpLayers",
    "ep_layers",
]

ALL_TO_ALLS = {"exact": 3, "padded": 2}
"""All-to-alls per MoE layer: (counts,) token rows with their routes side by side (one
all-to-all: `core.packing`), combined outputs."""
ROUTE_ROW_BYTES = 8
"""Each dispatched row carries, per route, its local expert index and routing weight as two
fp32 values: one route per row ("per_assignment"), top-k of them ("per_rank")."""
COUNT_BYTES = 8
"""One int64 count per peer and per kind in the exact mode's count exchange: assignments
("per_assignment"); rows and assignments ("per_rank")."""
EP_ROWS = ("per_assignment", "per_rank")
"""What one dispatched row is (`BackendOptions.ep_rows`)."""


@dataclass(frozen=True)
class EpLayer:
    """One rewritten MoE layer on this rank: what its statistics output means in bytes."""

    layer: int | None
    region: str
    dispatch: str
    ep: int
    experts_per_rank: int
    top_k: int
    token_row_bytes: int
    """D * element size: the bytes of one output row (combine), and of one token row
    (dispatch) unless `dispatch_row_bytes` says otherwise."""
    dispatch_row_bytes: int | None = None
    """The bytes of one dispatched token row when they are not `token_row_bytes`: the
    quantised rows (`core.adapter.ActivationRows`) of an input the model quantises."""
    rows: str = "per_assignment"
    """One of EP_ROWS: a row per (token, expert) assignment, or per (token, destination rank)."""
    why: str = ""
    """Why `rows` was chosen (with `ep_rows="auto"`: the expected bytes of both)."""

    @property
    def token_out_bytes(self) -> int:
        """The bytes of one dispatched token row."""
        return self.dispatch_row_bytes or self.token_row_bytes

    @property
    def routes_per_row(self) -> int:
        return self.top_k if self.rows == "per_rank" else 1

    @property
    def route_row_bytes(self) -> int:
        return ROUTE_ROW_BYTES * self.routes_per_row

    @property
    def stats_rows(self) -> int:
        """Rows of the `[stats_rows, ep]` statistics output: assignments sent and received,
        then ("per_rank") dispatched rows sent and received."""
        return 4 if self.rows == "per_rank" else 2

    @property
    def rows_per_token(self) -> int:
        """Padded rows per peer per local token: the most rows one token can send one peer,
        1 ("per_rank") or min(K, E/ep) (its K experts are distinct)."""
        return 1 if self.rows == "per_rank" else min(self.top_k, self.experts_per_rank)

    @property
    def expected_rows_per_peer(self) -> Fraction:
        """Rows one local token sends one given rank, expected under uniform routing (K
        distinct experts of E, E/ep per rank): K/ep per assignment; per rank, the chance that
        one of its K experts is on that rank, 1 - C(E - E/ep, K) / C(E, K)."""
        if self.rows == "per_assignment":
            return Fraction(self.top_k, self.ep)
        n_experts = self.experts_per_rank * self.ep
        missed = math.comb(n_experts - self.experts_per_rank, self.top_k)
        return 1 - Fraction(missed, math.comb(n_experts, self.top_k))

    def bytes_per_token(self, dispatch: str | None = None) -> float:
        """Dispatch + combine bytes one local token sends (and gets back) over the other ep - 1
        ranks: expected under uniform routing ("exact"), or its padded rows ("padded")."""
        dispatch = dispatch or self.dispatch
        rows = self.expected_rows_per_peer if dispatch == "exact" else self.rows_per_token
        row = self.token_out_bytes + self.token_row_bytes + self.route_row_bytes
        return float((self.ep - 1) * rows * row)

    def step_record(self, stats: torch.Tensor, ep_tokens: int, rank: int) -> dict[str, Any]:
        """The bytes rank `rank` sent in one call, from the graph's `[2, ep]` statistics output
        and (padded) the call's Tl_max. Pairwise all-to-all: the chunk a rank keeps is not
        sent."""
        table = stats.tolist()
        sent, received = table[:2]
        rows_sent, rows_received = table[2:] if self.rows == "per_rank" else table[:2]
        peers = [r for r in range(self.ep) if r != rank]
        valid_out = sum(rows_sent[r] for r in peers)
        valid_back = sum(rows_received[r] for r in peers)
        if self.dispatch == "exact":
            rows_out, rows_back = valid_out, valid_back
            count_bytes = (self.ep - 1) * COUNT_BYTES * (self.stats_rows // 2)
        else:
            rows_out = rows_back = (self.ep - 1) * ep_tokens * self.rows_per_token
            count_bytes = 0
        row_out = self.token_out_bytes + self.route_row_bytes
        return {
            "layer": self.layer,
            "rows": self.rows,
            "assignments_sent": sum(sent),
            "assignments_received": sum(received),
            "assignments_sent_per_rank": sent,
            "assignments_received_per_rank": received,
            "rows_sent_per_rank": rows_sent,
            "rows_received_per_rank": rows_received,
            "dispatch_rows_sent": rows_out,
            "dispatch_bytes_sent": rows_out * row_out + count_bytes,
            "combine_bytes_sent": rows_back * self.token_row_bytes,
            "valid_dispatch_bytes_sent": valid_out * row_out,
            "valid_combine_bytes_sent": valid_back * self.token_row_bytes,
        }


@dataclass(frozen=True)
class EpLayers:
    """What `expert_parallel` kept for a compile: one `EpLayer` per rewritten routed-experts
    node, in graph order (the order of the graph's extra EP-statistics outputs)."""

    layers: tuple[EpLayer, ...]


def ep_layers(ctx: CompileContext) -> tuple[EpLayer, ...]:
    """The MoE layers lowered over the EP group in this compile (none without EP)."""
    return ctx.get(EpLayers, EpLayers(())).layers
