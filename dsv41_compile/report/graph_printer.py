"""A rank-independent text form of a rewritten graph: one line per node with its placement and
local shape; sizes in the graph's named symbols (T, Tl_max); process group names replaced by
their mesh axis; parameters and inputs by their model names.

`stable_names=True` also replaces FX's counter names (`mul_1438`), which change whenever any
earlier part of the graph does, by positions in the printed text: `v0, v1, ...` for the
printed nodes and `in0, in1, ...` for values from outside the printed region. Names the passes
gave on purpose (`ep_rows`, `tp_rank`) stay. The expect snapshots use it, so they pin the
structure, not the counters.

Used by `graph.py` dumps, `tools/explain.py` and the expect tests.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import cast

import sympy
import torch
from torch.fx import GraphModule, Node

from dsv41_compile.core.meta import NAMED, OUT, REASON, REGION
from dsv41_compile.core.placements import format_placement
from dsv41_compile.core.symbols import graph_symbols
from dsv41_compile.core.torch_private import OpOverload, op_short_name, sym_expr

__all__ = ["format_folded", "format_graph"]

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int64: "i64", torch.bool: "b8",
           torch.float64: "f64", torch.int32: "i32", torch.uint8: "u8", torch.int8: "i8",
           torch.float8_e4m3fn: "e4m3", torch.float8_e8m0fnu: "e8m0"}  # fmt: skip
_OPS = {operator.add: "+", operator.sub: "-", operator.mul: "*", operator.floordiv: "//"}
_WORD = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")


def _size(s: object, names: dict[sympy.Expr, sympy.Symbol]) -> str:
    if isinstance(s, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(sympy.sympify(sym_expr(s)).xreplace(names)).replace(" ", "")
    return str(s)


def _value(val: object, names: dict[sympy.Expr, sympy.Symbol]) -> str:
    if isinstance(val, torch.Tensor):
        dims = ", ".join(_size(s, names) for s in val.shape)
        return f"{_DTYPES.get(val.dtype, str(val.dtype))}[{dims}]"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(_value(v, names) for v in val) + ")"
    if val is None:
        return ""
    return _size(val, names)


def _placement(out: object) -> str:
    if isinstance(out, tuple):
        return "(" + ", ".join(format_placement(p) for p in out) + ")"
    return format_placement(out) if out is not None else ""


def _target(node: Node) -> str:
    if node.target in _OPS:
        return _OPS[node.target]
    if isinstance(node.target, OpOverload):
        ns = node.target.namespace
        return f"{'' if ns == 'aten' else ns + '.'}{op_short_name(node.target)}"
    return getattr(node.target, "__name__", str(node.target))


class _Printer:
    def __init__(
        self,
        gm: GraphModule | None,
        labels: dict[str, str],
        groups: dict[str, str],
        printed: list[Node],
        stable_names: bool,
        anonymous: bool = False,
        like: _Printer | None = None,
    ) -> None:
        self.labels, self.groups = labels, groups
        self.anonymous = anonymous
        """Every name by position, the inputs' and the passes' names too (`format_folded`)."""
        # `like`: a printer of the same graph, whose symbols and names this one shares (`gm`
        # is given without it)
        self.symbols: dict[sympy.Expr, sympy.Symbol] = (
            like.symbols if like else graph_symbols(cast(GraphModule, gm))
        )
        self.stable = stable_names or anonymous
        kept = [n for n in printed if anonymous or not n.meta.get(NAMED)]
        self.names = {n: f"v{i}" for i, n in enumerate(kept)} if stable_names else {}
        self.external: dict[Node, str] = {}
        self.by_name: dict[str, Node] = (
            like.by_name if like else {n.name: n for n in cast(GraphModule, gm).graph.nodes}
        )

    def name(self, node: Node) -> str:
        if node in self.names:
            return self.names[node]
        if self.anonymous:
            return self.external.setdefault(node, f"in{len(self.external)}")
        if node.name in self.labels:
            return self.labels[node.name]
        if self.stable and not node.meta.get(NAMED) and node.op != "placeholder":
            return self.external.setdefault(node, f"in{len(self.external)}")
        return node.name

    def reason(self, text: str) -> str:
        """A reason names nodes: with stable names, by theirs. Only FX's counter names
        (`add_3`) are taken for nodes: a plain word ("index") is prose."""

        def word(m: re.Match) -> str:
            w = m.group()
            return self.name(self.by_name[w]) if w in self.by_name and "_" in w else w

        return _WORD.sub(word, text) if self.stable else text

    def arg(self, a: object) -> str:
        if isinstance(a, Node):
            return self.name(a)
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner})"
        if isinstance(a, str):
            return repr(self.groups.get(a, a))
        if isinstance(a, torch.dtype):
            return _DTYPES.get(a, str(a))
        if isinstance(a, int) and a >= 2**62:
            return "end"
        return repr(a)

    def line(self, node: Node) -> str:
        if node.op == "output":
            return f"return {self.arg(node.args[0])}"
        args = [self.arg(a) for a in node.args]
        args += [f"{k}={self.arg(v)}" for k, v in node.kwargs.items() if k != "device"]
        if node.target in _OPS and len(args) == 2:
            call = f"{args[0]} {_target(node)} {args[1]}"
        else:
            call = f"{_target(node)}({', '.join(args)})"
        comment = " ".join(
            x
            for x in (_placement(node.meta.get(OUT)), _value(node.meta.get("val"), self.symbols))
            if x
        )
        text = f"{self.name(node)} = {call}"
        collective = getattr(node.target, "namespace", None) == "_c10d_functional"
        if node.meta.get(REASON) and collective:
            comment += f"  <- {self.reason(node.meta[REASON])}"
        return f"{text}  # {comment}" if comment else text


def format_graph(
    gm: GraphModule,
    *,
    labels: dict[str, str] | None = None,
    groups: dict[str, str] | None = None,
    region: str | None = None,
    stable_names: bool = False,
) -> str:
    """The graph as text. `labels` renames placeholders (e.g. to parameter FQNs), `groups` maps
    process group names to axis names; `region` keeps only the nodes of one module (e.g.
    "layers.1") and its submodules; `stable_names` (see the module docstring)."""
    printed = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if region is not None:
            node_region = node.meta.get(REGION, "")
            if node.op == "output" or (
                node_region != region and not node_region.startswith(region + ".")
            ):
                continue
        printed.append(node)
    printer = _Printer(gm, dict(labels or {}), dict(groups or {}), printed, stable_names)
    return "\n".join(printer.line(node) for node in printed)


_UNBACKED = re.compile(r"\bu\d+\b")


def format_folded(
    gm: GraphModule,
    *,
    labels: dict[str, str] | None = None,
    groups: dict[str, str] | None = None,
    unit_of: Callable[[Node], str | None],
) -> str:
    """The graph as `format_graph` prints it, each repeated unit (`unit_of`: a decoder layer)
    whose plan equals an earlier unit's printed once.

    Two units have the same plan when they print the same with stable names, their inputs from
    outside (weights, cache tensors, the previous layer's values) numbered by first use and
    their data-dependent sizes by first appearance: the same ops, placements, local shapes and
    collectives, op for op. The first unit of such a group is printed in full, headed by what
    it takes and makes; each later one becomes one line where its first node was, `outputs =
    <first unit>(inputs)`, in the same order. A unit that reads a value defined after its
    first node stays in full."""
    labels, groups = dict(labels or {}), dict(groups or {})
    printed = [n for n in gm.graph.nodes if n.op != "placeholder"]
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    unit_by_node = {n: unit_of(n) for n in printed if n.op != "output"}
    units: dict[str, list[Node]] = {}
    for node, unit in unit_by_node.items():
        if unit is not None:
            units.setdefault(unit, []).append(node)
    inputs = {unit: _inputs(nodes) for unit, nodes in units.items()}
    printer = _Printer(gm, labels, groups, printed, stable_names=False)
    texts = {unit: _plan_text(printer, unit, nodes) for unit, nodes in units.items()}
    first_of: dict[str, str] = {}  # a plan -> the first unit with it
    calls: dict[str, tuple[str, bool]] = {}  # unit -> (the unit printed for it, own sizes)
    for unit, nodes in units.items():
        plan = _renumbered(texts[unit])
        shown = first_of.setdefault(plan, unit)
        if shown == unit or any(position[i] > position[nodes[0]] for i in inputs[unit]):
            continue
        calls[unit] = (shown, texts[unit] != texts[shown])
    folded = {shown for shown, _ in calls.values()}
    outputs = {
        shown: _output_positions(
            [units[shown]] + [units[u] for u, c in calls.items() if c[0] == shown]
        )
        for shown in folded
    }
    lines = []
    for node in printed:
        unit = unit_by_node.get(node)
        if unit in calls:
            if node is units[unit][0]:
                shown, own_sizes = calls[unit]
                nodes = units[unit]
                made = ", ".join(printer.name(nodes[k]) for k in outputs[shown])
                taken = ", ".join(printer.name(i) for i in inputs[unit])
                note = ", with data-dependent sizes of its own" if own_sizes else ""
                lines.append(f"{made} = {shown}({taken})  # {unit}: {shown}'s plan{note}")
            continue
        if unit in folded and node is units[unit][0]:
            nodes = units[unit]
            also = ", ".join(u for u, c in calls.items() if c[0] == unit)
            lines.append(
                f"# {unit}, printed once for itself and {also} (the same plan, called below): "
                f"takes ({', '.join(printer.name(i) for i in inputs[unit])}), makes "
                f"({', '.join(printer.name(nodes[k]) for k in outputs[unit])})"
            )
        lines.append(printer.line(node))
    return "\n".join(lines)


def _renumbered(text: str) -> str:
    """`text` with its data-dependent sizes (`u17`) named by first appearance."""
    names: dict[str, str] = {}
    return _UNBACKED.sub(lambda m: names.setdefault(m.group(), f"u{len(names)}"), text)


def _plan_text(like: _Printer, unit: str, nodes: list[Node]) -> str:
    """A unit's nodes printed with every name by position and its own path (in the reasons)
    as `<unit>`: comparable between units."""
    printer = _Printer(
        None, like.labels, like.groups, nodes, stable_names=True, anonymous=True, like=like
    )
    text = "\n".join(printer.line(n) for n in nodes)
    return re.sub(rf"\b{re.escape(unit)}\b", "<unit>", text)


def _inputs(nodes: list[Node]) -> list[Node]:
    """The values a unit reads from outside it, in order of first use."""
    inside = set(nodes)
    seen: dict[Node, None] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in inside:
                seen.setdefault(arg)
    return list(seen)


def _output_positions(copies: list[list[Node]]) -> list[int]:
    """The positions in a unit's node list of the values used outside any of its copies."""
    used: set[int] = set()
    for nodes in copies:
        inside = set(nodes)
        used |= {k for k, n in enumerate(nodes) if any(u not in inside for u in n.users)}
    return sorted(used)
