"""Packed ragged batches: the `(input_ids, positions, slots)` triple of the model contract."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Request", "pack"]


@dataclass(frozen=True)
class Request:
    """`len(ids)` tokens of cache slot `slot` (-1: padding rows), starting at position `start`."""

    slot: int
    ids: Sequence[int]
    start: int = 0


def pack(requests: Sequence[Request]) -> tuple[Tensor, Tensor, Tensor]:
    """Concatenate requests into one packed batch: int64 `(input_ids, positions, slots)`."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for req in requests:
        ids.extend(req.ids)
        positions.extend(range(req.start, req.start + len(req.ids)))
        slots.extend([req.slot] * len(req.ids))
    as_long = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return as_long(ids), as_long(positions), as_long(slots)
