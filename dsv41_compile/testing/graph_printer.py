"""A normalised, rank-independent text form of a rewritten graph: one line per node with its
placement and local shape; symbolic sizes in terms of T (the DP group's token count); process
group names replaced by their mesh axis; parameters and inputs by their model names.

Used by the expect tests, `tools/explain.py` and the `graph.py` dumps.
"""

from __future__ import annotations

import operator

import sympy
import torch
from torch.fx import GraphModule, Node

from dsv41_compile.fx_utils import OUT, REASON, REGION
from dsv41_compile.propagation.dtensor_adapter import format_placement

__all__ = ["format_graph", "format_node"]

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int64: "i64", torch.bool: "b8",
           torch.float64: "f64", torch.int32: "i32"}  # fmt: skip
_OPS = {operator.add: "+", operator.sub: "-", operator.mul: "*", operator.floordiv: "//"}


def _symbols(gm: GraphModule) -> dict[object, sympy.Symbol]:
    """T for the token count; Tl_max for the padded EP lowering's `ep_tokens` input."""
    names = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if not isinstance(val, torch.SymInt):
            continue
        if node.target is torch.ops.aten.sym_size.int and node.meta.get(REASON) == "T":
            names[val.node.expr] = sympy.Symbol("T", positive=True, integer=True)
        elif node.op == "placeholder" and node.name == "ep_tokens":
            names[val.node.expr] = sympy.Symbol("Tl_max", positive=True, integer=True)
    return names


def _size(s: object, names: dict[object, sympy.Symbol]) -> str:
    if isinstance(s, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(sympy.sympify(s.node.expr).xreplace(names)).replace(" ", "")
    return str(s)


def _value(val: object, names: dict[object, sympy.Symbol]) -> str:
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
    if isinstance(node.target, torch._ops.OpOverload):
        ns = node.target.namespace
        return f"{'' if ns == 'aten' else ns + '.'}{node.target._opname}"
    return getattr(node.target, "__name__", str(node.target))


def _arg(a: object, labels: dict[str, str], groups: dict[str, str]) -> str:
    if isinstance(a, Node):
        return labels.get(a.name, a.name)
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x, labels, groups) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner})"
    if isinstance(a, str):
        return repr(groups.get(a, a))
    if isinstance(a, torch.dtype):
        return _DTYPES.get(a, str(a))
    if isinstance(a, int) and a >= 2**62:
        return "end"
    return repr(a)


def format_node(
    node: Node, labels: dict[str, str], groups: dict[str, str], names: dict[object, sympy.Symbol]
) -> str:
    args = [_arg(a, labels, groups) for a in node.args]
    args += [f"{k}={_arg(v, labels, groups)}" for k, v in node.kwargs.items() if k != "device"]
    if node.target in _OPS and len(args) == 2:
        call = f"{args[0]} {_target(node)} {args[1]}"
    else:
        call = f"{_target(node)}({', '.join(args)})"
    comment = " ".join(
        x for x in (_placement(node.meta.get(OUT)), _value(node.meta.get("val"), names)) if x
    )
    line = f"{node.name} = {call}"
    if node.op == "call_function" and node.meta.get(REASON) and _is_collective(node):
        comment += f"  <- {node.meta[REASON]}"
    return f"{line}  # {comment}" if comment else line


def _is_collective(node: Node) -> bool:
    return (
        isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace == "_c10d_functional"
    )


def format_graph(
    gm: GraphModule,
    *,
    labels: dict[str, str] | None = None,
    groups: dict[str, str] | None = None,
    region: str | None = None,
) -> str:
    """The graph as text. `labels` renames placeholders (e.g. to parameter FQNs), `groups` maps
    process group names to axis names; `region` keeps only the nodes of one module (e.g.
    "layers.1") and its submodules."""
    labels, groups = dict(labels or {}), dict(groups or {})
    names = _symbols(gm)
    lines = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if region is not None:
            node_region = node.meta.get(REGION, "")
            if node_region != region and not node_region.startswith(region + "."):
                continue
        if node.op == "output":
            lines.append(f"return {_arg(node.args[0], labels, groups)}")
            continue
        lines.append(format_node(node, labels, groups, names))
    return "\n".join(lines)
