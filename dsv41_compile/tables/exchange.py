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

The DP groups' batches meet in the exchange: a rank serves every rank's token rows, a group
with no tokens included. The choice of placement is the adapter's (`ctx.choices`); each
exchange's reason names it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import cast

import torch
from torch.fx import GraphModule, Node

from dsv41_compile.core.adapter import TableLookup
from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.emitter import Emitter
from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.meta import GLOBAL_VAL, IN, REASON, TABLE, module_paths, replace_node
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
    for node, spec in targets:
        _rewrite(gm, node, spec, ctx, ep_tokens)
    gm.graph.lint()
    gm.recompile()


def _rewrite(
    gm: GraphModule, node: Node, spec: TableLookup, ctx: CompileContext, ep_tokens: Node
) -> None:
    table, scale, rows, columns, *constants = node.args
    bounds = list(cast(Sequence[int], columns))
    n_columns, world = len(bounds) - 1, ctx.mesh.world_size
    k = -(-n_columns // world)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    shard = ctx.signature.param_shards[placeholders.index(table)]
    local_rows = shard.local_shape(table.meta[GLOBAL_VAL].shape)[0]
    for held in (table, scale):  # the rank holds its rows as the bytes the exchange moves
        _hold_as_bytes(cast(Node, held), placeholders.index(held), ctx)
    host = node.meta[IN][0].host
    width, scales = (v.meta[GLOBAL_VAL].shape[1] for v in (table, scale))
    row = width + scales  # bytes a row moves: its e4m3 codes and e8m0 scales
    choice = ctx.choice_for(module_paths(node))  # the adapter's, behind the placement
    group, why = ctx.mesh.ep_group_name, f" ({choice})" if choice else ""
    device = rows.meta[GLOBAL_VAL].device
    emit = Emitter(gm.graph)
    with emit.inserting_before(node) as added:
        p = emit.proxy
        tl, capacity = aten.sym_size.int(p(rows), 0), p(ep_tokens)
        # each column's ids as rows of the rank holding it: minus that rank's first row
        firsts = [
            emit.call(aten.scalar_tensor.default, bounds[min(c // k * k, n_columns)],
                      dtype=torch.int64, device=device)
            for c in range(n_columns)
        ]  # fmt: skip
        local = aten.sub.Tensor(p(rows), aten.stack.default(firsts))  # [Tl, C]
        padded = aten.constant_pad_nd.default(local, [0, world * k - n_columns], -1)
        by_rank = aten.permute.default(aten.view.default(padded, [tl, world, k]), [1, 0, 2])
        ids = aten.constant_pad_nd.default(by_rank, [0, 0, 0, capacity - tl], -1)
        dense = aten.clone.default(ids, memory_format=torch.contiguous_format)
        splits = [capacity * k] * world
        asked = _all_to_all(
            emit, aten.view.default(dense, [-1]), splits, group, "table_ids",
            f"table rows: each token's row ids, {k} to each rank, as rows of its part{why}",
        )  # fmt: skip
        if host:  # the rank's part of the table lives in host memory: look up there
            asked = aten._to_copy.default(asked, device=torch.device("cpu"))
        valid = aten.logical_and.default(
            aten.ge.Scalar(asked, 0), aten.lt.Scalar(asked, local_rows)
        )
        index = aten.where.ScalarOther(valid, asked, 0)
        codes = aten.index_select.default(p(table), 0, index)
        exps = aten.index_select.default(p(scale), 0, index)
        found = aten.mul.Tensor(
            aten.cat.default([codes, exps], 1), aten.unsqueeze.default(valid, 1)
        )
        if host:
            found = aten._to_copy.default(found, device=device)
        back = _all_to_all(
            emit, found, splits, group, "table_rows",
            f"table rows back: FP8 codes with their e8m0 scales, {row} B a row{why}",
        )  # fmt: skip
        blocks = aten.view.default(back, [world, capacity, k, row])
        mine = aten.slice.Tensor(blocks, 1, 0, tl)
        by_token = aten.permute.default(mine, [1, 0, 2, 3])
        columns_in_order = aten.reshape.default(by_token, [tl, world * k, row])
        in_order = aten.slice.Tensor(columns_in_order, 1, 0, n_columns)
        got = aten.split_with_sizes.default(in_order, [width, scales], -1)
        dense = [aten.clone.default(got[i], memory_format=torch.contiguous_format) for i in (0, 1)]
        out = spec.dequantize(*dense, *constants)
    replace_node(node, out.node, added)


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
) -> object:
    """The all-to-all of `value` and its wait, named `name`; both carry the reason (graph.py
    prints the wait's, comm.json records the collective's)."""
    sent = c10d.all_to_all_single.default(value, splits, splits, group)
    sent.node.meta.update({REASON: why, TABLE: True})
    done = emit.named(c10d.wait_tensor.default(sent), name, why)
    done.node.meta[TABLE] = True
    return done
