"""Rows of several values moved as one: their `[rows, columns]` side by side in one tensor (as
bytes where their dtypes differ), and split back into each value after the move.

A collective pays its latency once however many columns it moves (docs/devices.md), so values
that go the same way over the same group at the same point move together: a layer's entry
gathers (`spmd.coalesce`), the EP dispatch's token rows and routes (`moe.expert_parallel`).
Every value comes back bit for bit.

The emitters take `call(target, *args)`, which makes one node: `Graph.call_function` in a pass
that edits nodes, the op itself on `fx.Proxy`s in one that traces. The byte views are written
so that torch's `view.dtype` and GE's `Bitcast` (what torchair converts it to: a wider element
gains or loses a last dim of its size in bytes, the shape is not folded into the last dim) give
the same shapes: a reshape around every change of element size.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Column", "pack", "packed_dtype", "packed_width", "unpack"]

aten = torch.ops.aten
Call = Callable[..., Any]


@dataclass(frozen=True)
class Column:
    """One value's part of the packed rows: its dtype and the sizes of one of its rows (its
    trailing dims: `(d,)` for a `[rows, d]` value), flattened to `columns` side by side."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def columns(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()


def _as_row(call: Call, value: Any, column: Column, as_bytes: bool) -> Any:
    """`[rows, *shape]` as `[rows, columns]`, or as `[rows, columns * itemsize]` uint8."""
    if not as_bytes:
        if len(column.shape) == 1:
            return value
        return call(aten.view.default, call(aten.clone.default, value), [-1, column.columns])
    dense = call(aten.clone.default, value)  # a view of dtype needs contiguous rows
    as_uint8 = call(aten.view.dtype, dense, torch.uint8)
    if column.itemsize == 1 and len(column.shape) == 1:
        return as_uint8
    return call(aten.view.default, as_uint8, [-1, column.columns * column.itemsize])


def _from_bytes(call: Call, dense: Any, column: Column) -> Any:
    """`[rows, columns * itemsize]` uint8 back as `[rows, columns]` of the column's dtype."""
    if column.itemsize == 1:
        return call(aten.view.dtype, dense, column.dtype)
    grouped = call(aten.view.default, dense, [-1, column.columns, column.itemsize])
    return call(
        aten.view.default, call(aten.view.dtype, grouped, column.dtype), [-1, column.columns]
    )


def packed_dtype(columns: Sequence[Column]) -> torch.dtype:
    """The packed rows' dtype: the values' own where they share one, else bytes."""
    return torch.uint8 if _mixed(columns) else columns[0].dtype


def packed_width(columns: Sequence[Column]) -> int:
    """The packed rows' width, in elements of `packed_dtype(columns)`."""
    return sum(c.columns * c.itemsize for c in columns) // packed_dtype(columns).itemsize


def _mixed(columns: Sequence[Column]) -> bool:
    return len({c.dtype for c in columns}) > 1


def pack(call: Call, values: Sequence[Any], columns: Sequence[Column]) -> Any:
    """The values' rows side by side: `[rows, sum of columns]` (of bytes where dtypes differ)."""
    as_bytes = _mixed(columns)
    rows = [_as_row(call, v, c, as_bytes) for v, c in zip(values, columns, strict=True)]
    return call(aten.cat.default, rows, 1)


def unpack(call: Call, packed: Any, columns: Sequence[Column]) -> list[Any]:
    """Each value back out of `pack`'s result (moved or not), `[rows, *shape]`, contiguous."""
    as_bytes = _mixed(columns)
    widths = [c.columns * (c.itemsize if as_bytes else 1) for c in columns]
    split = call(aten.split_with_sizes.default, packed, widths, 1)
    values = []
    for i, column in enumerate(columns):
        value = call(aten.clone.default, call(operator.getitem, split, i))
        if as_bytes:
            value = _from_bytes(call, value, column)
        if len(column.shape) > 1:
            value = call(aten.view.default, value, [-1, *column.shape])
        values.append(value)
    return values
