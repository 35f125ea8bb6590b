"""Emitter: how the rewriting passes write ATen calls into a graph through FX proxies, so the
code that builds a replacement reads as torch code (moe.expert_parallel, targets.npu_passes, the models' graph-mode rewrites)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.fx import Graph, Node, Proxy
from torch.fx.proxy import GraphAppendingTracer

from dsv41_compile.core.meta import NAMED, REASON
from dsv41_compile.core.torch_private import rename_node

__all__ = ["Emitter", "cast"]

aten = torch.ops.aten


class Emitter:
    """Writes into `graph` at its insertion point; `named` gives the values worth reading a
    name."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.tracer = GraphAppendingTracer(graph)

    def proxy(self, arg: Any) -> Any:
        """`arg` with its nodes (also inside lists and tuples) as proxies."""
        if isinstance(arg, Node):
            return Proxy(arg, self.tracer)
        if isinstance(arg, (list, tuple)):
            return type(arg)(self.proxy(a) for a in arg)
        return arg

    def call(self, op: Any, *args: Any, **kwargs: Any) -> Proxy:
        """A node for `op` even when no argument is a proxy (factories would run eagerly)."""
        return self.tracer.create_proxy("call_function", op, args, kwargs)

    def named(self, value: Proxy, name: str, why: str | None = None) -> Proxy:
        rename_node(value.node, name)
        value.node.meta[NAMED] = True
        if why is not None:
            value.node.meta[REASON] = why
        return value

    @contextmanager
    def inserting_before(self, node: Node) -> Iterator[list[Node]]:
        """Emit before `node`; the yielded list holds the nodes emitted, once the block ends."""
        before = set(self.graph.nodes)
        added: list[Node] = []
        with self.graph.inserting_before(node):
            yield added
        added += [n for n in self.graph.nodes if n not in before]


def cast(value: Proxy, src: torch.dtype, dst: torch.dtype) -> Proxy:
    """`value` (of dtype `src`) in `dst`, with no node when they agree."""
    return value if src == dst else aten._to_copy.default(value, dtype=dst)
