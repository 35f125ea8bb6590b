"""Small facts about FX nodes that every pass needs: the meta keys the passes write, the module a
node came from, its model source line, and how a replacement inherits them."""

from __future__ import annotations

import re

import torch
from torch.fx import Node

__all__ = [
    "GLOBAL_VAL",
    "IN",
    "NAMED",
    "OUT",
    "REASON",
    "REGION",
    "RULE",
    "SYMBOL",
    "describe",
    "is_tensor",
    "module_paths",
    "replace_node",
    "source_line",
    "tensor_inputs",
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


def is_tensor(x: object) -> bool:
    """`x` is a node with a tensor value: its "val", or for a node a pass inserted before the
    values were propagated again, the global value it stands for (`GLOBAL_VAL`)."""
    if not isinstance(x, Node):
        return False
    return isinstance(x.meta.get("val", x.meta.get(GLOBAL_VAL)), torch.Tensor)


def tensor_inputs(node: Node) -> list[Node]:
    """The tensor-valued input nodes of `node`, in pytree order of its args (repeats kept)."""
    leaves: list[Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), lambda n: leaves.append(n) or n)
    return [n for n in leaves if is_tensor(n)]
