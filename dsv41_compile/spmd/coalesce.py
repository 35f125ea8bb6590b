"""coalesce: a decoder layer's entry gathers made one AllGather.

Requires: entry_cut, localize (per-rank shapes), and the passes that rewrite collectives'
payloads (`quantised_transport`). Ensures: in each decoder layer, the TP AllGathers of the
values its entry cut leaves on the token shards (`spmd.entry_cut.entry_cuts`; not an op's own
exchange, such as a shift's neighbour rows) that move `[Tl, ...]` rows of static trailing
sizes and do not depend on one another are one AllGather: their rows flattened side by side
(as bytes where their dtypes differ: `core.packing`), gathered, and split back into each value
after the wait. Each value after the wait is the one its own gather gave, bit for bit; the
graph stays in a topological order that keeps every other node where it was relative to the
rest.

Why: a decode step waits on each collective's latency (10-30 us on HCCL / NCCL,
docs/devices.md), and the entry cut gathers each latent it moves on its own, 2-5 per layer at
flash sizes; their bytes together are a few kB per token. One gather pays the latency once.

The merged gather names its members (`meta[COALESCED]`: their names, dtypes and column
counts), which `report.comm` records (`comm.json`'s "members"); its reason is theirs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import Argument

from dsv41_compile.core.collectives import collective_axis, collective_ends, collective_kind
from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.errors import as_node
from dsv41_compile.core.fake_prop import propagate_nodes
from dsv41_compile.core.meta import COALESCED, OUT, REASON, REGION
from dsv41_compile.core.packing import Column, pack, unpack
from dsv41_compile.spmd.entry_cut import entry_cuts

__all__ = ["coalesce_gathers"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def coalesce_gathers(gm: GraphModule, *, ctx: CompileContext) -> None:
    entry = _entry_values(ctx)
    if not entry:  # no layer's entry cut gathers its values
        return
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups: dict[tuple[int | None, object], list[Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if _candidate(node, entry, ctx):
            layer = ctx.adapter.site(node.meta.get(REGION, "")).layer
            rows = str(_moved(node).meta["val"].shape[0])  # the same rows: Tl (a symbol)
            groups[(layer, rows)].append(node)
    made: list[Node] = []
    for members in groups.values():
        independent = _independent(members, order)
        if len(independent) > 1:
            made += _merge(gm.graph, independent, order)
    if made:
        propagate_nodes(made, ctx)
        _topological_sort(gm.graph)
        gm.graph.lint()
        gm.recompile()


def _entry_values(ctx: CompileContext) -> set[Node]:
    """The values the entry cuts gather (`spmd.entry_cut`), and the input of each that is the
    model's activation quantisation (`quantised_transport` moves its encoded rows instead)."""
    quantize = ctx.adapter.activation_rows and ctx.adapter.activation_rows.quantize
    values: set[Node] = set()
    for cut in entry_cuts(ctx).values():
        for value in cut.gathered if cut.sharded else ():
            values.add(value)
            if value.target == quantize and isinstance(value.args[0], Node):
                values.add(value.args[0])
    return values


def _candidate(node: Node, entry: set[Node], ctx: CompileContext) -> bool:
    """A TP AllGather, whose only use is its wait, of a value an entry cut gathers (so in a
    decoder layer, and not an op's own exchange: a shift's rows), of `[rows, ...]` rows of
    static trailing sizes."""
    if collective_kind(node) != "all_gather" or collective_axis(node, ctx.mesh) != "tp":
        return False
    users = list(node.users)
    if len(users) != 1 or users[0].target is not c10d.wait_tensor.default:
        return False
    if collective_ends(node)[0] not in entry:
        return False
    val = _moved(node).meta["val"]
    return val.dim() >= 2 and all(isinstance(size, int) for size in val.shape[1:])


def _independent(members: list[Node], order: dict[Node, int]) -> list[Node]:
    """The members, in graph order, less any whose input depends on an earlier kept member's
    result (merging those would make a cycle)."""
    kept: list[Node] = []
    for node in members:
        if not any(_depends_on(_moved(node), k, order) for k in kept):
            kept.append(node)
    return kept


def _moved(gather: Node) -> Node:
    return as_node(gather.args[0], "the value a collective moves")


def _depends_on(value: Node, gather: Node, order: dict[Node, int]) -> bool:
    """Whether `value` is computed from `gather`'s result (a search back to the gather's place
    in the graph)."""
    todo, seen, floor = [value], set(), order[gather]
    while todo:
        node = todo.pop()
        if node is gather:
            return True
        if node in seen or order.get(node, -1) < floor:
            continue
        seen.add(node)
        todo += node.all_input_nodes
    return False


def _merge(graph: Graph, gathers: Sequence[Node], order: dict[Node, int]) -> list[Node]:
    """One AllGather for `gathers`; returns the nodes made, in order."""
    values = [_moved(g) for g in gathers]
    vals = [v.meta["val"] for v in values]
    _, tp, group = gathers[0].args
    last = max(values, key=lambda v: order[v])
    parts = (p for g in gathers for p in g.meta.get(REASON, "").split("; "))  # shared once
    reason = (
        f"{len(gathers)} entry gathers of layer values as one AllGather (a latency each saved): "
        + "; ".join(dict.fromkeys(parts))
    )
    made: list[Node] = []
    with graph.inserting_after(last):

        def call(target: Callable[..., object], *args: Argument) -> Node:
            node = graph.call_function(target, args)
            made.append(node)
            return node

        columns = [Column(v.dtype, tuple(v.shape[1:])) for v in vals]
        rows = pack(call, values, columns)
        gathered = call(c10d.all_gather_into_tensor.default, rows, tp, group)
        outs = unpack(call, call(c10d.wait_tensor.default, gathered), columns)
    for n in made:
        n.meta[REASON] = reason
        n.meta[OUT] = None
        n.meta[REGION] = gathers[0].meta.get(REGION, "")
        for key in ("stack_trace", "nn_module_stack"):
            if key in gathers[0].meta:
                n.meta[key] = gathers[0].meta[key]
    gathered.meta[COALESCED] = tuple(
        (g.name, str(c.dtype).removeprefix("torch."), c.columns)
        for g, c in zip(gathers, columns, strict=True)
    )
    for g, out in zip(gathers, outs):
        (wait,) = g.users
        wait.replace_all_uses_with(out)
        graph.erase_node(wait)
        graph.erase_node(g)
    return made


def _topological_sort(graph: Graph) -> None:
    """Reorder the nodes so each comes after its inputs, keeping the graph's order otherwise
    (a node moves only as far as an input placed after it requires)."""
    nodes = list(graph.nodes)
    placed: set[Node] = set()
    waiting: dict[Node, list[Node]] = defaultdict(list)  # input -> nodes waiting for it
    ordered: list[Node] = []

    def place(node: Node) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            missing = [a for a in n.all_input_nodes if a not in placed]
            if missing:
                waiting[missing[0]].append(n)
                continue
            placed.add(n)
            ordered.append(n)
            stack += reversed(waiting.pop(n, []))

    for node in nodes:
        if node not in placed:
            place(node)
    if ordered == nodes:
        return
    previous = ordered[0]
    for node in ordered[1:]:
        previous.append(node)
        previous = node
