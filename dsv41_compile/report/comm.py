"""The collectives of a per-rank graph: their kind, axis and the bytes they move, as formulas in
the graph's named sizes (`core.symbols`: T, Tl_max), and the communication records `comm.json`
holds.

Bytes are what this rank sends and receives, from the local shapes: ring all-gather /
reduce-scatter ((tp-1) shards each way), ring all-reduce (a reduce-scatter then an all-gather:
2(tp-1)/tp of the buffer each way), pairwise all-to-all (every chunk but the rank's own).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import sympy
import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from dsv41_compile.core.collectives import collective_axis, collective_kind
from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.meta import COALESCED, REASON, REGION, RIDING
from dsv41_compile.core.symbols import TL_MAX, T, graph_symbols, in_named_symbols, size_expr
from dsv41_compile.core.torch_private import sym_expr

__all__ = [
    "EXAMPLE_TOKEN_COUNTS",
    "ExtraCollective",
    "ExtraCollectives",
    "collective_bytes",
    "comm_records",
    "format_size",
]

EXAMPLE_TOKEN_COUNTS = (1, 8, 2048)


@dataclass(frozen=True)
class ExtraCollective:
    """A TP collective of a decoder layer beyond the layout's (`ModelAdapter.
    expected_collectives`): what an edit of the model costs, and the op that needs it."""

    layer: int
    half: str
    """Where in the layer: "attention half", "MoE half" or "between its halves" (the
    layer's own ops, outside both modules)."""
    node: str
    kind: str
    reason: str
    """The collective's reason: which op needs which value in which placement, and why."""
    line: str
    """The model source line of the op that needs it."""

    def text(self) -> str:
        at = f" at {self.line}" if self.line else ""
        return f"layer {self.layer}, {self.half}: {self.kind}(tp) {self.node}{at} <- {self.reason}"


@dataclass(frozen=True)
class ExtraCollectives:
    """verify's list of every decoder layer's collectives beyond the layout's, in graph order
    (`graph.py` prints it under its inputs)."""

    collectives: tuple[ExtraCollective, ...]


def _numel(val: torch.Tensor) -> sympy.Expr:
    return sympy.Mul(*(size_expr(s) for s in val.shape))


def _a2a_bytes(splits: Sequence[object], val: torch.Tensor, rank: int) -> sympy.Expr:
    """Bytes of the chunks for the other ranks (the chunk at `rank` stays)."""
    exprs = [size_expr(s) for s in splits]
    row = val.element_size() * math.prod(int(d) for d in val.shape[1:])
    return (sum(exprs, sympy.Integer(0)) - exprs[rank]) * row


def collective_bytes(node: Node, ctx: CompileContext) -> tuple[str, int, sympy.Expr, sympy.Expr]:
    """(axis, group size, bytes this rank sends, bytes it receives) of a collective node, in the
    graph's own symbols (data-dependent all-to-all splits stay unbacked symbols)."""
    kind, axis = collective_kind(node), collective_axis(node, ctx.mesh)
    inp, out = node.args[0].meta["val"], node.meta["val"]
    tp = ctx.mesh.tp
    if kind == "all_to_all":
        rank = ctx.mesh.axis_rank(axis)
        group_size = ctx.mesh.ep if axis == "ep" else tp
        return (
            axis,
            group_size,
            _a2a_bytes(cast(Sequence[object], node.args[2]), inp, rank),
            _a2a_bytes(cast(Sequence[object], node.args[1]), out, rank),
        )
    if kind == "all_reduce":
        moved = sympy.Rational(2 * (tp - 1), tp) * _numel(inp) * inp.element_size()
    else:
        shard = inp if kind == "all_gather" else out
        moved = (tp - 1) * _numel(shard) * shard.element_size()
    return axis, tp, moved, moved


def format_size(size: object, names: dict[sympy.Expr, sympy.Symbol]) -> str:
    """A size in the graph's named symbols (`((T + 3)//4)`); a sum of consecutively numbered
    ones as their range (`sum(ep_recv_8..15)`: the rows the 8 EP ranks send this rank)."""
    if not isinstance(size, torch.SymInt):
        return str(size)
    expr = sympy.sympify(sym_expr(size)).xreplace(names)
    args = sympy.Add.make_args(expr)
    terms = [re.fullmatch(r"(.+)_(\d+)", str(t)) if isinstance(t, sympy.Symbol) else None
             for t in args]  # fmt: skip
    matched = [t for t in terms if t is not None]
    if len(args) > 2 and len(matched) == len(terms) and len({t[1] for t in matched}) == 1:
        numbers = sorted(int(t[2]) for t in matched)
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            return f"sum({matched[0][1]}_{numbers[0]}..{numbers[-1]})"
    return str(expr)


def comm_records(gm: GraphModule, ctx: CompileContext) -> list[dict[str, Any]]:
    """One record per collective: kind, axis, group size, dtype, local shapes, bytes this rank
    sends and receives as a formula in T and at a few token counts, layer, region, reason, and
    for a coalesced AllGather the gathers it stands for ("members": name, dtype, columns). A
    padded EP all-to-all's formula is in Tl_max (its values at T assume every DP group serves T
    tokens); an exact one's sizes are data-dependent ("data-dependent": `comm.json`'s
    `ep_steps` has each call's bytes)."""
    names = graph_symbols(gm)
    shape_names = {**_read_sizes(gm), **names}
    records = []
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        axis, group_size, sent, received = collective_bytes(node, ctx)
        sent, received = (in_named_symbols(e, names) for e in (sent, received))
        inp, out = node.args[0].meta["val"], node.meta["val"]
        region = node.meta.get(REGION, "")
        records.append(
            {
                "node": node.name,
                "kind": kind,
                "axis": axis,
                "group_size": group_size,
                "dtype": str(inp.dtype).removeprefix("torch."),
                "input_shape": [format_size(s, shape_names) for s in inp.shape],
                "output_shape": [format_size(s, shape_names) for s in out.shape],
                "bytes_sent": _format_bytes(sent),
                "bytes_received": _format_bytes(received),
                "bytes_sent_at": _bytes_at(sent, ctx.mesh.tp),
                "bytes_received_at": _bytes_at(received, ctx.mesh.tp),
                "layer": ctx.adapter.site(region).layer,
                "region": region,
                "reason": node.meta.get(REASON, ""),
            }
        )
        if RIDING in node.meta:  # a table's exchange in it (`tables`): bytes per token slot
            own, rider = node.meta[RIDING]
            records[-1]["riding"] = {"own_bytes_per_slot": own, "rider_bytes_per_slot": rider}
        if COALESCED in node.meta:  # one AllGather standing for several (`spmd.coalesce`)
            records[-1]["members"] = [
                {"gather": name, "dtype": dtype, "columns": columns}
                for name, dtype, columns in node.meta[COALESCED]
            ]
    return records


def _read_sizes(gm: GraphModule) -> dict[sympy.Symbol, sympy.Symbol]:
    """Each size the graph reads from data (an unbacked symbol that a node's value is) by the
    name of that node, as graph.py calls it: `ep_recv_3`, the rows EP rank 3 sends this rank."""
    names: dict[sympy.Symbol, sympy.Symbol] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        expr = sym_expr(val) if isinstance(val, torch.SymInt) else None
        if isinstance(expr, sympy.Symbol) and free_unbacked_symbols(expr):
            names.setdefault(expr, sympy.Symbol(node.name))
    return names


def _format_bytes(expr: sympy.Expr | None) -> str:
    return "data-dependent" if expr is None else str(expr)


def _bytes_at(expr: sympy.Expr | None, tp: int) -> dict[str, int] | None:
    """`expr` at a few T, every DP group serving T tokens (so Tl_max = ceil(T/tp))."""
    if expr is None:
        return None
    return {f"T={t}": int(expr.xreplace({T: t, TL_MAX: -(-t // tp)})) for t in EXAMPLE_TOKEN_COUNTS}
