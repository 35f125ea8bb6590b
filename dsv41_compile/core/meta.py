"""Small facts about FX nodes that every pass needs: the meta keys the passes write, the module a
node came from, its model source line, and how a replacement inherits them."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TypeGuard

import sympy
import torch
from torch.fx import Node

from dsv41_compile.core.torch_private import sym_expr

__all__ = [
    "CAPTURE_FIX",
    "COALESCED",
    "EP_PADDED",
    "EP_SOURCE",
    "EP_TOKENS",
    "GLOBAL_VAL",
    "IN",
    "NAMED",
    "OUT",
    "REAL_ROWS",
    "REASON",
    "REGION",
    "RIDING",
    "RULE",
    "SYMBOL",
    "describe",
    "is_tensor",
    "metadata_key",
    "module_paths",
    "replace_node",
    "source_line",
    "tensor_inputs",
    "Unkeyed",
]

# node.meta keys written by the passes
IN = "dsv41_in"  # tuple[Placement, ...]: required placement of each tensor input, in arg order
OUT = "dsv41_out"  # Placement | tuple[Placement | None, ...] | None: placement of the output(s)
RULE = "dsv41_rule"  # str: which rule decided, e.g. "dtensor (S(1), S(0)) -> P"
REGION = "dsv41_region"  # str: the anchored module the node belongs to ("" at top level)
REASON = "dsv41_reason"  # str: on inserted nodes, why they exist
GLOBAL_VAL = "dsv41_global_val"  # the node's value before localization (global shapes)
SYMBOL = "dsv41_symbol"  # str: the name a size node prints as ("T", "Tl_max"); see core.symbols
NAMED = "dsv41_named"  # bool: a pass chose the node's name (`Emitter.named`); printers keep it
TABLE = "dsv41_table"  # bool: a collective of a column-split table's exchange (`tables`)
REAL_ROWS = "dsv41_real_rows"  # bool: a token shard whose padding rows hold a reduction's identity
CAPTURE_FIX = "dsv41_capture_fix"  # str: on a node a captured graph cannot run (a host read), the option that avoids it
# tuple[(name, dtype, columns), ...]: the gathers an AllGather stands for (`spmd.coalesce`)
COALESCED = "dsv41_coalesced"
EP_SOURCE = (
    "dsv41_ep_source"  # bool: the node reads what the EP dispatch sends (its first argument)
)
# tuple[str, int, torch.dtype, int]: on a padded EP lowering's all-to-all, ("dispatch" |
# "combine", its rows per peer per Tl_max, the rows' dtype, their width): an exchange whose
# sizes the graph knows, which another exchange over its group can ride (`tables`)
EP_PADDED = "dsv41_ep_padded"
# tuple[int, int]: on an all-to-all another rides (`tables`), the bytes per token slot of its
# own rows and of the rider's (`report.accounting` gives each its share)
RIDING = "dsv41_riding"

EP_TOKENS = "ep_tokens"
"""The padded EP lowering's extra graph input: the largest token-shard length Tl over the EP group
(the DP groups' token counts differ), agreed on the host before each call."""

_ROOT = re.compile(r"^L\['self'\]\.?")


def module_paths(node: Node) -> list[str]:
    """The model modules enclosing `node`, outermost first, as FQNs (`layers.0.attn`)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for path, _cls in stack.values():
        fqn = _ROOT.sub("", path)
        fqn = re.sub(r"\[(\d+)\]", r".\1", fqn)
        if fqn:
            paths.append(fqn)
    return paths


def source_line(node: Node) -> str:
    """The innermost model source line of `node` ("file:line: code"), or "" when unknown."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]+\n\s*(.*)', trace)
    if not frames:
        return ""
    file, line, code = frames[-1]
    return f"{file}:{line}: {code.strip()}"


def describe(node: Node) -> str:
    """`node` for an error message: name, op, module and source line."""
    paths = module_paths(node)
    where = f" in module {paths[-1]}" if paths else ""
    line = source_line(node)
    return f"node {node.name} ({node.target}){where}" + (f" at {line}" if line else "")


def replace_node(node: Node, out: Node, added: list[Node], reason: str | None = None) -> None:
    """`out`, computed by the `added` nodes, takes the place of `node`: the added nodes carry
    `node`'s source line, module stack and region (and `reason`, when given), `out` its
    placement and global value; `node` is erased."""
    for new in added:
        for key in ("stack_trace", "nn_module_stack"):
            if key in node.meta:
                new.meta[key] = node.meta[key]
        new.meta[REGION] = node.meta.get(REGION, "")
        new.meta.setdefault(OUT, None)
        if reason is not None:
            new.meta[REASON] = reason
    for key in (OUT, GLOBAL_VAL):
        if key in node.meta:
            out.meta[key] = node.meta[key]
    node.replace_all_uses_with(out)
    node.graph.erase_node(node)


def is_tensor(x: object) -> TypeGuard[Node]:
    """`x` is a node with a tensor value: its "val", or for a node a pass inserted before the
    values were propagated again, the global value it stands for (`GLOBAL_VAL`)."""
    if not isinstance(x, Node):
        return False
    return isinstance(x.meta.get("val", x.meta.get(GLOBAL_VAL)), torch.Tensor)


def tensor_inputs(node: Node) -> list[Node]:
    """The tensor-valued input nodes of `node`, in pytree order of its args (repeats kept)."""
    leaves: list[Node] = []

    def keep(n: Node) -> Node:
        leaves.append(n)
        return n

    torch.fx.node.map_arg((node.args, node.kwargs), keep)
    return [n for n in leaves if is_tensor(n)]


class Unkeyed(Exception):
    """A value `metadata_key` cannot stand for by its metadata."""


def metadata_key(value: object) -> object:
    """A hashable stand-in for `value` by its metadata (shapes, strides, storage offset, dtype,
    device, sizes as symbolic expressions), not its identity or data: what an operator's fake
    result depends on. Raises `Unkeyed` for a tensor holding a constant (its data matters) or a
    value of another kind."""
    if isinstance(value, torch.Tensor):
        if getattr(value, "constant", None) is not None:
            raise Unkeyed
        return (
            "T",
            _exprs(value.shape),
            _exprs(value.stride()),
            _exprs([value.storage_offset()]),
            value.dtype,
            value.device,
        )
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        canonical = _canonical(value)
        return ("S", canonical) if isinstance(canonical, sympy.Basic) else canonical
    if isinstance(value, list | tuple):
        return (type(value).__name__, *(metadata_key(v) for v in value))
    if isinstance(value, dict):
        return ("D", *((k, metadata_key(v)) for k, v in value.items()))
    if value is None or isinstance(value, _PLAIN):
        return value
    raise Unkeyed


_PLAIN = (int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _exprs(sizes: Iterable[object]) -> tuple[object, ...]:
    return tuple(_canonical(s) if isinstance(s, torch.SymInt) else s for s in sizes)


def _canonical(size: torch.SymInt | torch.SymFloat | torch.SymBool) -> object:
    """`size`'s expression with what its shape env has learnt since it was made (a symbol
    found equal to a number or to another symbol), a number as a plain one: two values of one
    size made before and after a `torch._check`, or a size and the int it was found to be, key
    alike."""
    expr = sym_expr(size)
    shape_env = getattr(size.node, "shape_env", None)
    if shape_env is not None:
        expr = shape_env.replace(expr)
    if expr is sympy.true or expr is sympy.false:
        return bool(expr)
    if getattr(expr, "is_number", False):
        return int(expr) if expr.is_integer else float(expr)
    return expr
