"""The collectives a rewritten graph may hold: their kinds, the mesh axis each runs on, and the
values the EP dispatches send. What they cost is `report.comm`'s; which run where, the passes'."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx import GraphModule, Node

from dsv41_compile.core.errors import InternalError, as_node
from dsv41_compile.core.mesh import Mesh
from dsv41_compile.core.meta import EP_SOURCE, REASON

__all__ = [
    "COLLECTIVES",
    "collective_axis",
    "collective_ends",
    "collective_kind",
    "dispatched_values",
]

c10d = torch.ops._c10d_functional
COLLECTIVES: dict[Callable[..., Any] | str, str] = {  # keyed like `Node.target`
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_reduce.default: "all_reduce",
    c10d.all_to_all_single.default: "all_to_all",
}
"""Functional collective op -> its kind."""


def collective_kind(node: Node) -> str | None:
    """ "all_gather", "reduce_scatter", "all_reduce", "all_to_all", or None for another node."""
    return COLLECTIVES.get(node.target) if node.op == "call_function" else None


def collective_axis(node: Node, mesh: Mesh) -> str:
    """ "tp" or "ep": the mesh axis whose process group a collective runs on."""
    group = node.args[-1]
    if group == mesh.tp_group_name:
        return "tp"
    if group == mesh.ep_group_name:
        return "ep"
    raise InternalError(f"a collective runs on an unknown process group {group!r}", node)


def dispatched_values(gm: GraphModule) -> list[Node]:
    """The values the EP dispatches of `gm` send: token rows and routing tables (the first
    argument of every node marked `EP_SOURCE`)."""
    return [n.args[0] for n in gm.graph.nodes if n.meta.get(EP_SOURCE)]


def collective_ends(node: Node) -> tuple[Node, list[Node]]:
    """The value a collective redistributes and the model nodes that read the result: past the
    nodes inserted around it (pads, waits, splits: they carry a reason)."""
    producer = as_node(node.args[0], "the value a collective moves")
    while REASON in producer.meta and producer.op == "call_function":
        inputs = [a for a in producer.args if isinstance(a, Node)]
        if not inputs:  # made here (an exchange's index): no model value before it
            break
        producer = inputs[0]
    consumers, todo = [], list(node.users)
    while todo:
        user = todo.pop()
        if REASON in user.meta and user.op == "call_function":
            todo += list(user.users)
        else:
            consumers.append(user)
    return producer, consumers
