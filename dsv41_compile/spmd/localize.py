"""localize: global shapes -> per-rank shapes.

Requires: annotate and insert (placements on every node, collectives in place).
Ensures: `ctx.signature`, the program's inputs, with the shard of each sharded parameter (the
runtime hands the graph the local shard, sliced once: a tp shard by `tp_rank`, an expert shard
by the world rank); every size argument that names a sharded dim is the local size (a
`-1` where the op can infer it, the token-shard length `Tl`, or `size // tp`); a vocab-sharded
embedding looks up only its own rows and leaves zeros elsewhere (its partial sum); the ops
along the token dim compute this rank's rows (`spmd.token_ops`: a partial over the tokens
reads no padding row, a mean divides by T, a scan adds the shards before it, a shift or a roll
takes the rows it needs from the other ranks). Ops that would create a sharded tensor from a
global size are refused.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import cast

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dsv41_compile.core.adapter import TableLookup
from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.meta import GLOBAL_VAL, OUT, REASON, describe
from dsv41_compile.core.placements import ColumnShard, ExpertShard
from dsv41_compile.core.signature import ParamInput, ParamShard, ProgramSignature
from dsv41_compile.spmd.token_ops import localize_token_ops
from dsv41_compile.spmd.transitions import TokenSizes

__all__ = ["column_ranges", "localize"]

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_FACTORIES = {
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default,
    aten.zeros.default, aten.ones.default, aten.empty.memory_format, aten.new_zeros.default,
    aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
}  # fmt: skip


def localize(gm: GraphModule, *, ctx: CompileContext) -> None:
    mesh = ctx.mesh
    tp = mesh.tp
    ctx.signature = _signature(gm, ctx)
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        out = node.meta.get(OUT)
        if node.target in _VIEWS and isinstance(out, Shard):
            sizes = _local_view_sizes(node, list(node.args[1]), out.dim, tp, ctx)
            node.args = (node.args[0], sizes)
        elif node.target is aten.expand.default and isinstance(out, Shard):
            node.args = (node.args[0], _local_expand_sizes(node, out.dim, ctx))
        elif node.target is aten.slice.Tensor and isinstance(out, Shard):
            _check_full_slice(node, out.dim)
        elif node.target is aten.embedding.default and isinstance(node.args[0].meta[OUT], Shard):
            _localize_vocab_sharded_embedding(gm, node, ctx)
        elif node.target in _FACTORIES and isinstance(out, Shard):
            raise NotImplementedError(
                f"{describe(node)} creates a {out} tensor from a global size; compute it from a "
                f"token-sharded input instead"
            )
    localize_token_ops(gm, ctx.get(TokenSizes))
    gm.graph.lint()
    gm.recompile()


def _signature(gm: GraphModule, ctx: CompileContext) -> ProgramSignature:
    """The model's inputs (before `tp_rank`), each parameter with the shard its placement asks
    for."""
    params, inputs = [], []
    for index, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        if node.name == "tp_rank":
            break
        fqn = ctx.param_fqns.get(node.name)
        if fqn is None:
            inputs.append((index, ctx.input_sources[node.name]))
            continue
        placement, val = node.meta.get(OUT), node.meta.get(GLOBAL_VAL, node.meta.get("val"))
        shard = None
        if isinstance(placement, Shard):
            shard = ParamShard(fqn, placement, placement.dim, ctx.mesh.tp, "tp")
        elif isinstance(placement, ExpertShard):
            shard = ParamShard(fqn, placement, placement.dim, ctx.mesh.ep, "ep")
        elif isinstance(placement, ColumnShard):
            ranges = column_ranges(node, ctx)
            shard = ParamShard(fqn, placement, 0, ctx.mesh.world_size, "ep", ranges)
        buffer = node.name in ctx.buffers
        shape = tuple(int(s) for s in val.shape)
        params.append(ParamInput(index, fqn, shape, val.dtype, buffer, shard))
    return ProgramSignature(tuple(params), tuple(inputs), tuple(ctx.adapter.token_inputs))


def column_ranges(table: Node, ctx: CompileContext) -> tuple[tuple[int, int], ...]:
    """The rows each rank holds of a column-split table (`placements.ColumnShard`): with C
    columns (bounds from the table-lookup op that reads it) over the world's W ranks, rank r
    holds columns `[r*k, (r+1)*k)`, k = ceil(C/W): their rows, `[bounds[r*k], bounds[...]]`
    (none for a rank past the last column)."""
    lookup = next((u for u in table.users if ctx.adapter.table_lookup_op(u.target)), None)
    if lookup is None:
        raise InternalError(
            "a column-split table is read by no table-lookup op of the model family", table
        )
    bounds = list(cast(Sequence[int], lookup.args[TableLookup.COLUMNS]))
    columns, world = len(bounds) - 1, ctx.mesh.world_size
    k = -(-columns // world)
    return tuple(
        (bounds[min(r * k, columns)], bounds[min((r + 1) * k, columns)]) for r in range(world)
    )


def _local_view_sizes(
    node: Node, sizes: list[object], dim: int, tp: int, ctx: CompileContext
) -> list[object]:
    # A static sharded dim gets its local size written out, and so does a -1 beside it whose
    # global size is static: a view keeps at most one -1, on a dim whose neighbours are never
    # 0 (with T = 0 tokens a -1 next to a T dim would be ambiguous).
    out = node.meta[GLOBAL_VAL].shape
    sizes = [out[i] if s == -1 and isinstance(out[i], int) else s for i, s in enumerate(sizes)]
    size = sizes[dim]
    if isinstance(size, int):
        if size % tp:
            raise ValueError(
                f"{describe(node)} splits a dim of size {size} that is sharded over tp={tp}; "
                f"{ctx.adapter.tp_advice(size)}"
            )
        sizes[dim] = size // tp
    elif -1 not in sizes:
        sizes[dim] = -1  # a token-sharded dim: the local numel fixes it
    else:
        raise NotImplementedError(
            f"{describe(node)} views a token-sharded tensor with two symbolic sizes {sizes}"
        )
    return sizes


def _local_expand_sizes(node: Node, dim: int, ctx: CompileContext) -> list[object]:
    sizes = list(cast(Sequence[object], node.args[1]))
    source = node.args[0].meta[GLOBAL_VAL]
    offset = len(sizes) - source.dim()
    if sizes[dim] == -1:
        return sizes
    if dim >= offset and not statically_known_true(source.shape[dim - offset] == 1):
        sizes[dim] = -1  # expand keeps a non-broadcast dim: the input's local size
        return sizes
    size = sizes[dim]
    if isinstance(size, int) and size % ctx.mesh.tp == 0:
        sizes[dim] = size // ctx.mesh.tp
    elif isinstance(size, Node) and size.meta.get("val") == ctx.get(TokenSizes).T.meta.get("val"):
        sizes[dim] = ctx.get(TokenSizes).Tl
    else:
        raise NotImplementedError(f"{describe(node)}: cannot localize a broadcast to a sharded dim")
    return sizes


def _check_full_slice(node: Node, dim: int) -> None:
    _, slice_dim, start, end, *step = node.args
    val = node.args[0].meta[GLOBAL_VAL]
    if slice_dim % val.dim() != dim:
        return
    if start != 0 or (step and step[0] != 1):
        raise NotImplementedError(f"{describe(node)} slices a sharded dim")
    size = val.shape[dim]
    end_val = end.meta.get("val") if isinstance(end, Node) else end
    if not (end_val == sys.maxsize or statically_known_true(end_val == size)):
        raise NotImplementedError(f"{describe(node)} slices a sharded dim")
    node.args = (node.args[0], slice_dim, 0, sys.maxsize, *step)


def _localize_vocab_sharded_embedding(gm: GraphModule, node: Node, ctx: CompileContext) -> None:
    # Rank k holds rows [k*Vl, (k+1)*Vl): it looks up the ids in its range and contributes zeros
    # for the rest, so the sum over the TP group (the entry ReduceScatter) is the embedding.
    weight, ids = node.args[:2]
    rows = weight.meta[GLOBAL_VAL].shape[0] // ctx.mesh.tp
    g = gm.graph
    with g.inserting_before(node):
        offset = g.call_function(aten.mul.Tensor, (ctx.get(TokenSizes).tp_rank, rows))
        local = g.call_function(aten.sub.Tensor, (ids, offset))
        mine = g.call_function(
            aten.bitwise_and.Tensor,
            (
                g.call_function(aten.ge.Scalar, (local, 0)),
                g.call_function(aten.lt.Scalar, (local, rows)),
            ),
        )
        safe = g.call_function(aten.mul.Tensor, (local, mine))
    with g.inserting_after(node):
        keep = g.call_function(aten.unsqueeze.default, (mine, -1))
    with g.inserting_after(keep):
        masked = g.call_function(aten.mul.Tensor, (node, keep))
    node.replace_all_uses_with(masked, delete_user_cb=lambda user: user is not masked)
    node.args = (weight, safe, *node.args[2:])
    # The lookup itself is no placement: rows of other ranks' ids hold this rank's row 0
    # until the mask zeroes them; the masked value is the partial sum.
    node.meta[OUT] = None
    for n in (offset, local, mine, safe, keep, masked, *mine.args):
        n.meta[OUT] = Partial() if n is masked else Replicate()
        n.meta[REASON] = (
            "vocab-sharded embedding: zeros for other ranks' rows (a partial sum)"
            if n is masked
            else "vocab-sharded embedding: look up this rank's rows only"
        )
        for key in ("stack_trace", "nn_module_stack"):
            if key in node.meta:
                n.meta[key] = node.meta[key]
