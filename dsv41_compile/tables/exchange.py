"""tables: a lookup into a table split by its columns over the world becomes an exchange of row
ids and rows.

The ops are the model adapter's `table_lookups` (`core.adapter.TableLookup`, whose contract this
pass relies on: `op(table, scale, rows [T, C], columns, *constants)`, column c's rows in
`[columns[c], columns[c+1])`). A table placed `placements.ColumnShard` is held by column: with
C columns over the world's W ranks, rank r holds the rows of columns `[r*k, (r+1)*k)`,
k = ceil(C/W), padded to the longest range (`spmd.localize.column_ranges`).

Requires: localize (the op's rows are this rank's token shard, `[Tl, C]`; the table its own
rows). Ensures: no lookup of a column-split table is left. In its place, on every rank:

    ids       each token's C row ids, as rows of the rank holding the column (the global id
              minus that rank's first row), k to each rank, in a static buffer of Tl_max rows
              per rank (`ep_tokens`: the DP groups' token counts differ; unused rows -1)
                                                                            all-to-all(world)
    lookup    the rows asked for, from this rank's part of the table: the e4m3 codes and
              their e8m0 scales, as bytes (in host memory for a `host` table, then moved to
              the device); ids outside it (-1) give zero bytes
    rows      back to the asking rank, FP8 with their scales                all-to-all(world)
    values    the asking rank's rows, its C columns in order, dequantised (the adapter's
              `dequantize`: the arithmetic the op itself does)

Lookups whose row ids depend on no earlier lookup share one exchange, before the first
(`_batches`): their ids side by side per token slot in one all-to-all, their rows side by side
in the other, the later ones' row ids computed before it. The model's Engram layers all hash
the input ids, so a step makes one exchange however many Engram layers it has.

The exchange then rides in the last padded EP exchange that ends before it (`_ride`): its ids
leave beside the dispatch's rows, its rows come back beside the combine's, and it has no
collective of its own.

The DP groups' batches meet in the exchange: a rank serves every rank's token rows, a group
with no tokens included. The choice of placement is the adapter's (`ctx.choices`); each
exchange's reason names it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch.fx import Graph, GraphModule, Node, Proxy

from dsv41_compile.core.adapter import TableLookup
from dsv41_compile.core.collectives import collective_kind
from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.emitter import Emitter
from dsv41_compile.core.errors import InternalError, as_node
from dsv41_compile.core.meta import (
    EP_PADDED,
    GLOBAL_VAL,
    IN,
    REASON,
    RIDING,
    TABLE,
    module_paths,
    replace_node,
)
from dsv41_compile.core.packing import Column, pack, packed_dtype, packed_width, unpack
from dsv41_compile.core.placements import ColumnShard

__all__ = ["table_exchange"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def table_exchange(gm: GraphModule, *, ctx: CompileContext) -> None:
    targets = []
    for node in gm.graph.nodes:
        spec = ctx.adapter.table_lookup_op(node.target)
        if spec is not None and isinstance((node.meta.get(IN) or (None,))[0], ColumnShard):
            targets.append((node, spec))
    if not targets:
        return
    ep_tokens = ctx.ep_tokens_input(gm)
    for batch in _batches(targets):
        _ride(gm, *_exchange(gm, batch, ctx, ep_tokens), ep_tokens)
    gm.graph.lint()
    gm.recompile()


def _batches(targets: list[tuple[Node, TableLookup]]) -> list[list[tuple[Node, TableLookup]]]:
    """The lookups in program order, cut where one's row ids depend on an earlier lookup of its
    batch (or on an op with a side effect after the batch's first): a batch's lookups share one
    exchange at its first's place. The model's Engram layers hash the input ids, so they are
    one batch: one exchange per step, not one per Engram layer."""
    order = {n: i for i, n in enumerate(targets[0][0].graph.nodes)}
    batches: list[list[tuple[Node, TableLookup]]] = []
    for node, spec in targets:
        if batches:
            first = batches[-1][0][0]
            members = {n for n, _ in batches[-1]}
            needed = _needed_after(first, node.args[2], order)
            if not needed & members and not any(n.is_impure() for n in needed):
                batches[-1].append((node, spec))
                continue
        batches.append([(node, spec)])
    return batches


def _needed_after(first: Node, value: object, order: dict[Node, int]) -> set[Node]:
    """The nodes `value` is computed from (itself included) that come after `first`."""
    needed: set[Node] = set()
    stack = [value] if isinstance(value, Node) else []
    while stack:
        n = stack.pop()
        if n in needed or order[n] < order[first]:
            continue
        needed.add(n)
        stack.extend(n.all_input_nodes)
    return needed


@dataclasses.dataclass(frozen=True)
class _Member:
    """One lookup of a batch: its table's layout on this rank and what its rows move."""

    node: Node
    spec: TableLookup
    bounds: list[int]  # the column bounds
    k: int  # columns per rank
    local_rows: int  # the rows of this rank's part
    width: int  # e4m3 codes per row
    scales: int  # e8m0 scales per row
    host: bool  # this rank's part lives in host memory

    @property
    def row(self) -> int:
        """Bytes a row moves: its codes and its scales."""
        return self.width + self.scales


def _member(
    node: Node, spec: TableLookup, placeholders: list[Node], ctx: CompileContext
) -> _Member:
    table, scale, _rows, columns, *_ = node.args
    bounds = list(cast(Sequence[int], columns))
    k = -(-(len(bounds) - 1) // ctx.mesh.world_size)
    shard = ctx.signature.param_shards[placeholders.index(cast(Node, table))]
    local_rows = shard.local_shape(cast(Node, table).meta[GLOBAL_VAL].shape)[0]
    for held in (table, scale):  # the rank holds its rows as the bytes the exchange moves
        _hold_as_bytes(cast(Node, held), placeholders.index(cast(Node, held)), ctx)
    width, scales = (cast(Node, v).meta[GLOBAL_VAL].shape[1] for v in (table, scale))
    return _Member(node, spec, bounds, k, local_rows, width, scales, node.meta[IN][0].host)


def _exchange(
    gm: GraphModule, batch: list[tuple[Node, TableLookup]], ctx: CompileContext, ep_tokens: Node
) -> tuple[Node, Node, tuple[int, int]]:
    """One exchange for the batch's lookups, before the first: every lookup's ids in one
    all-to-all, side by side per token slot, and their rows back in another. Returns the two
    all-to-alls' waits, the ids per token slot and the bytes of a slot's rows."""
    first = batch[0][0]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    hoisted = set().union(*(_needed_after(first, n.args[2], order) for n, _ in batch[1:]))
    for n in sorted(hoisted, key=order.__getitem__):  # later row ids, computed before `first`
        first.prepend(n)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    members = [_member(node, spec, placeholders, ctx) for node, spec in batch]
    world = ctx.mesh.world_size
    choice = ctx.choice_for(module_paths(first))  # the adapter's, behind the placement
    group, why = ctx.mesh.ep_group_name, f" ({choice})" if choice else ""
    if len(members) == 1:
        what = f"{members[0].k}"
    else:
        names = ", ".join(_where(m.node) for m in members)
        what = f"{' + '.join(str(m.k) for m in members)} (the {len(members)} lookups of {names})"
    rows0 = cast(Node, first.args[2])
    device = rows0.meta[GLOBAL_VAL].device
    emit = Emitter(gm.graph)
    with emit.inserting_before(first) as added:
        p = emit.proxy
        tl, capacity = aten.sym_size.int(p(rows0), 0), p(ep_tokens)
        ids = [_ids(emit, m, tl, capacity, world, device) for m in members]
        slots = sum(m.k for m in members)
        dense = aten.clone.default(
            ids[0] if len(ids) == 1 else aten.cat.default(ids, 2),
            memory_format=torch.contiguous_format,
        )
        asked_all = _all_to_all(
            emit, aten.view.default(dense, [-1]), [capacity * slots] * world, group,
            "table_ids",
            f"table rows: each token's row ids, {what} to each rank, as rows of its part{why}",
        )  # fmt: skip
        by_slot = aten.view.default(asked_all, [world, capacity, slots])
        asked = aten.split_with_sizes.default(by_slot, [m.k for m in members], 2)
        found = [
            _found(emit, m, aten.reshape.default(asked[i], [-1]), world, capacity, device)
            for i, m in enumerate(members)
        ]
        row = sum(m.k * m.row for m in members)
        back = _all_to_all(
            emit, found[0] if len(found) == 1 else aten.cat.default(found, 1),
            [capacity] * world, group, "table_rows",
            f"table rows back: FP8 codes with their e8m0 scales, "
            f"{' + '.join(str(m.row) for m in members)} B a row{why}",
        )  # fmt: skip
        parts = aten.split_with_sizes.default(
            aten.view.default(back, [world, capacity, row]), [m.k * m.row for m in members], 2
        )
    # the exchange goes with the first lookup (its source line and region), each lookup's
    # values with their own
    outs: list[tuple[Node, list[Node]]] = []
    for i, m in enumerate(members):
        with emit.inserting_before(first) as values:
            value = _values(m, parts[i], tl, world)
        outs.append((value.node, (added if i == 0 else []) + values))
    for m, (out, nodes) in zip(members, outs, strict=True):
        replace_node(m.node, out, nodes)
    return asked_all.node, back.node, (slots, row)


def _where(node: Node) -> str:
    """The innermost module of a lookup (`layers.14.engram.embed`), or its node's name."""
    paths = module_paths(node)
    return paths[-1] if paths else node.name


def _ids(emit: Emitter, m: _Member, tl: Any, capacity: Any, world: int, device: Any) -> Proxy:
    """Each token's ids of `m`'s columns as rows of the rank holding them (the global id minus
    that rank's first row), `[world, capacity, k]`: k to each rank, unused slots -1."""
    p, n_columns = emit.proxy, len(m.bounds) - 1
    firsts = [
        emit.call(aten.scalar_tensor.default, m.bounds[min(c // m.k * m.k, n_columns)],
                  dtype=torch.int64, device=device)
        for c in range(n_columns)
    ]  # fmt: skip
    local = aten.sub.Tensor(p(m.node.args[2]), aten.stack.default(firsts))  # [Tl, C]
    padded = aten.constant_pad_nd.default(local, [0, world * m.k - n_columns], -1)
    by_rank = aten.permute.default(aten.view.default(padded, [tl, world, m.k]), [1, 0, 2])
    return aten.constant_pad_nd.default(by_rank, [0, 0, 0, capacity - tl], -1)


def _found(emit: Emitter, m: _Member, asked: Any, world: int, capacity: Any, device: Any) -> Proxy:
    """The rows every rank asked of this rank's part of `m`'s table, `[world * capacity,
    k * row]` bytes: the e4m3 codes and their e8m0 scales (looked up in host memory for a
    `host` table); ids outside the part (-1) give zero bytes."""
    p = emit.proxy
    table, scale = m.node.args[:2]
    if m.host:
        asked = aten._to_copy.default(asked, device=torch.device("cpu"))
    valid = aten.logical_and.default(aten.ge.Scalar(asked, 0), aten.lt.Scalar(asked, m.local_rows))
    index = aten.where.ScalarOther(valid, asked, 0)
    codes = aten.index_select.default(p(table), 0, index)
    exps = aten.index_select.default(p(scale), 0, index)
    found = aten.mul.Tensor(aten.cat.default([codes, exps], 1), aten.unsqueeze.default(valid, 1))
    if m.host:
        found = aten._to_copy.default(found, device=device)
    return aten.view.default(found, [world * capacity, m.k * m.row])


def _values(m: _Member, back: Any, tl: Any, world: int) -> Proxy:
    """The asking rank's rows of `m`'s lookup from its part of the rows back (`[world,
    capacity, k * row]`), its C columns in order, dequantised (the adapter's `dequantize`)."""
    n_columns = len(m.bounds) - 1
    blocks = aten.reshape.default(back, [world, -1, m.k, m.row])
    mine = aten.slice.Tensor(blocks, 1, 0, tl)
    by_token = aten.permute.default(mine, [1, 0, 2, 3])
    columns_in_order = aten.reshape.default(by_token, [tl, world * m.k, m.row])
    in_order = aten.slice.Tensor(columns_in_order, 1, 0, n_columns)
    got = aten.split_with_sizes.default(in_order, [m.width, m.scales], -1)
    dense = [aten.clone.default(got[i], memory_format=torch.contiguous_format) for i in (0, 1)]
    return m.spec.dequantize(*dense, *m.node.args[4:])


def _hold_as_bytes(node: Node, index: int, ctx: CompileContext) -> None:
    """The program takes the parameter at `index` (one byte per element: FP8 codes, e8m0
    scales) as uint8, its bytes unchanged: no kernel of any target reads the 8-bit float
    formats, and the exchange moves bytes."""
    shard = ctx.signature.param_shards[index]
    value = node.meta["val"]
    if value.dtype == torch.uint8 and not shard.host:
        return
    if value.element_size() != 1:
        raise InternalError(
            f"a column-split table of {value.dtype}: its bytes are not its elements", node
        )
    ctx.signature = ctx.signature.with_shard(index, dataclasses.replace(shard, dtype=torch.uint8))
    device = torch.device("cpu") if shard.host else value.device
    with ctx.fake_mode:
        node.meta["val"] = torch.empty(value.shape, dtype=torch.uint8, device=device)


def _all_to_all(
    emit: Emitter, value: object, splits: list[object], group: str, name: str, why: str
) -> Proxy:
    """The all-to-all of `value` and its wait, named `name`; both carry the reason (graph.py
    prints the wait's, comm.json records the collective's)."""
    sent = c10d.all_to_all_single.default(value, splits, splits, group)
    sent.node.meta.update({REASON: why, TABLE: True})
    done = emit.named(c10d.wait_tensor.default(sent), name, why)
    done.node.meta[TABLE] = True
    return done


def _ride(gm: GraphModule, ids: Node, rows: Node, widths: tuple[int, int], ep_tokens: Node) -> None:
    """The exchange's two all-to-alls (waits `ids` and `rows`; `widths`: the ids per token slot,
    the bytes a slot's rows take) ride in the last padded EP exchange that ends before it
    (`meta[EP_PADDED]`: a MoE layer's dispatch and combine, over the same group, every peer's
    block sized by the same Tl_max): the row ids leave with the dispatch's rows and the table's
    rows come back with the combine, side by side per token slot (`core.packing`, as bytes).
    Two latencies a step saved, not a byte more or less. The row ids (the model's: hashes of
    the input ids) are computed before the dispatch, the rows looked up before the combine.
    Where no such exchange precedes the lookups (an Engram layer before the first MoE layer,
    the exact dispatch, whose sizes are read on the host) or the ids need a collective of
    their own, the exchange stays on its own."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    ids_a2a, rows_a2a = (as_node(w.args[0], "the all-to-all waited on") for w in (ids, rows))
    carrier = _carrier(graph, ids_a2a, order)
    if carrier is None:
        return
    dispatch, combine = carrier
    hoisted = _needed_after(dispatch, ids_a2a.args[0], order)
    # the lookup, from the ids received (with the dispatch, before the combine)
    looked_up = _needed_after(combine, rows_a2a.args[0], order) - hoisted - {ids_a2a, ids}
    if not _movable(hoisted) or not _movable(looked_up):
        return
    for n in sorted(hoisted, key=order.__getitem__):  # the row ids, before the dispatch
        dispatch.prepend(n)
    _merge(graph, dispatch, ids, Column(torch.int64, (widths[0],)), ep_tokens, [-1])
    for n in sorted(looked_up, key=order.__getitem__):  # the rows, before the combine
        combine.prepend(n)
    _merge(graph, combine, rows, Column(torch.uint8, (widths[1],)), ep_tokens, [-1, widths[1]])


def _carrier(graph: Graph, ids_a2a: Node, order: dict[Node, int]) -> tuple[Node, Node] | None:
    """The last padded EP exchange (dispatch, combine) over `ids_a2a`'s group that ends before
    it, or None."""
    group = ids_a2a.args[3]
    found: dict[str, Node] = {}
    last = None
    for node in graph.nodes:
        if node is ids_a2a:
            break
        mark = node.meta.get(EP_PADDED)
        if mark is not None and node.args[3] == group:
            found[mark[0]] = node
            if mark[0] == "combine" and "dispatch" in found:
                last = (found["dispatch"], node)
    return last


def _movable(nodes: set[Node]) -> bool:
    """Whether `nodes` may move earlier: computations, no collective, no side effect."""
    return all(
        n.op == "call_function"
        and not n.is_impure()
        and collective_kind(n) is None
        and n.target is not c10d.wait_tensor.default
        for n in nodes
    )


def _merge(
    graph: Graph,
    carrier: Node,
    rider_wait: Node,
    rider: Column,
    ep_tokens: Node,
    shape: list[int],
) -> None:
    """The all-to-all `carrier` (padded EP, `meta[EP_PADDED]`) also moves what the all-to-all
    of `rider_wait` moves (`rider`: its columns per token slot, Tl_max slots per peer; `shape`:
    its value's): one all-to-all of both side by side per slot; each value after the wait is
    the one its own all-to-all gave, bit for bit."""
    kind, per_token, dtype, width = carrier.meta[EP_PADDED]
    rider_a2a = as_node(rider_wait.args[0], "the all-to-all waited on")
    (carrier_wait,) = carrier.users
    group, peers = carrier.args[3], len(cast(list[object], carrier.args[1]))
    columns = [Column(dtype, (per_token * width,)), rider]
    emit = Emitter(graph)
    with emit.inserting_before(carrier) as added:
        p = emit.proxy
        slots = [
            aten.view.default(p(carrier.args[0]), [-1, per_token * width]),
            aten.view.default(p(rider_a2a.args[0]), [-1, rider.columns]),
        ]
        splits = [p(ep_tokens)] * peers
        sent = c10d.all_to_all_single.default(pack(_traced, slots, columns), splits, splits, group)
        moved = c10d.wait_tensor.default(sent)
        mine, its = unpack(_traced, moved, columns)
        outs = [aten.view.default(mine, [-1, width]), aten.view.default(its, shape)]
    why = f"{carrier_wait.meta[REASON]}; with {rider_wait.meta[REASON]} (riding: a latency saved)"
    # what it sends now: one packed row per token slot (another exchange could ride in it too)
    packed = (kind, 1, packed_dtype(columns), packed_width(columns))
    riding = tuple(c.columns * c.itemsize for c in columns)  # bytes per slot: its own, the rider's
    sent.node.meta.update({REASON: why, EP_PADDED: packed, RIDING: riding})
    name = carrier_wait.name
    split_sizes = (cast(list[object], n.args[1]) for n in (carrier, rider_a2a))
    sizes = [a for splits in split_sizes for a in splits if isinstance(a, Node)]
    replace_node(carrier_wait, outs[0].node, added)  # the carrier's source line and region
    rider_wait.replace_all_uses_with(outs[1].node)
    for n in (carrier, rider_wait, rider_a2a):
        graph.erase_node(n)
    for n in dict.fromkeys(sizes):  # their split sizes, now unread
        if not n.users and _movable({n}):
            graph.erase_node(n)
    emit.named(moved, name, why)


def _traced(target: Any, *args: Any) -> Any:
    """An op on proxies (`core.packing`'s emitters): traced into the graph."""
    return target(*args)
