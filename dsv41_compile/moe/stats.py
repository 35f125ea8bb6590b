"""What an expert-parallel MoE layer moves: the per-layer description (`EpLayer`) that turns
its statistics output into bytes, and the sizes the accounting shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ALL_TO_ALLS", "COUNT_BYTES", "EP_TOKENS", "ROUTE_ROW_BYTES", "EpLayer"]

ALL_TO_ALLS = {"exact": 4, "padded": 3}
"""All-to-alls per MoE layer: (counts,) token rows, routes, combined outputs."""
ROUTE_ROW_BYTES = 8
"""Each dispatched row carries its local expert index and routing weight as two fp32 values."""
COUNT_BYTES = 8
"""One int64 assignment count per peer in the exact mode's count exchange."""


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
    """D * element size: the bytes of one token row (dispatch) or one output row (combine)."""

    @property
    def rows_per_token(self) -> int:
        """Padded rows per peer per local token: min(K, E/ep)."""
        return min(self.top_k, self.experts_per_rank)

    def step_record(self, stats: torch.Tensor, ep_tokens: int, rank: int) -> dict[str, Any]:
        """The bytes rank `rank` sent in one call, from the graph's `[2, ep]` statistics output
        and (padded) the call's Tl_max. Pairwise all-to-all: the chunk a rank keeps is not
        sent."""
        sent, received = stats.tolist()
        peers = [r for r in range(self.ep) if r != rank]
        if self.dispatch == "exact":
            rows_out = sum(sent[r] for r in peers)
            rows_back = sum(received[r] for r in peers)
            count_bytes = (self.ep - 1) * COUNT_BYTES
        else:
            rows_out = rows_back = (self.ep - 1) * ep_tokens * self.rows_per_token
            count_bytes = 0
        valid_out = sum(sent[r] for r in peers)
        valid_back = sum(received[r] for r in peers)
        return {
            "layer": self.layer,
            "assignments_sent": sum(sent),
            "assignments_received": sum(received),
            "assignments_sent_per_rank": sent,
            "assignments_received_per_rank": received,
            "dispatch_rows_sent": rows_out,
            "dispatch_bytes_sent": rows_out * (self.token_row_bytes + ROUTE_ROW_BYTES)
            + count_bytes,
            "combine_bytes_sent": rows_back * self.token_row_bytes,
            "valid_dispatch_bytes_sent": valid_out * (self.token_row_bytes + ROUTE_ROW_BYTES),
            "valid_combine_bytes_sent": valid_back * self.token_row_bytes,
        }


EP_TOKENS = "ep_tokens"
"""The padded lowering's extra graph input: the largest token-shard length Tl over the EP group
(the DP groups' token counts differ), agreed on the host before each call."""
