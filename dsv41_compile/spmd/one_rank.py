"""one_rank: a collective over a TP group of one rank moves nothing; it is removed.

At `tp=1` (attention data-parallel: every DP group is one rank) the plan still places values
on the TP axis and `insert` still redistributes them, over a group of one: an all-gather of the
whole value, a reduce-scatter or all-reduce of a sum with one term. Each returns its input as it
is, but would still cost a collective call (and its latency) per use on the device.

Requires: localize (per-rank shapes: a one-rank collective's result is its input; verify's
re-propagation checks the shapes after).
Ensures: no collective over the TP group when `tp == 1`; the readers of each removed
collective's result read its input.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from dsv41_compile.core.collectives import collective_axis, collective_kind
from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.errors import InternalError

__all__ = ["drop_one_rank_collectives"]

_WAIT = torch.ops._c10d_functional.wait_tensor.default


def drop_one_rank_collectives(gm: GraphModule, *, ctx: CompileContext) -> None:
    if ctx.mesh.tp != 1:
        return
    for node in list(gm.graph.nodes):
        if collective_kind(node) is None or collective_axis(node, ctx.mesh) != "tp":
            continue
        source = node.args[0]
        if not isinstance(source, Node):
            raise InternalError("a collective reads no graph value", node)
        for user in list(node.users):
            if user.target is _WAIT:
                user.replace_all_uses_with(source)
                gm.graph.erase_node(user)
        node.replace_all_uses_with(source)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
