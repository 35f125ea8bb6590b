"""The ops along the token dim of token shards: their per-rank forms (their rules:
`spmd.rules.token_ops`).

A token shard is rank r's `Tl = ceil(T/tp)` rows `[r*Tl, (r+1)*Tl)` of the token dim, padded
at the global tail (`spmd.transitions`). An op that works row by row runs on the shard as it
is. An op that mixes rows needs rows of other ranks; by the rules, each kind gets the cheapest
exchange that is exact for every T -- the shards uneven, some of them empty of tokens -- and a
padding row never enters a statistic, a scan or a shift:

    op (along the token dim)       placement       per rank                        exchange
    sum, amax, amin                S(0) -> P       over the real rows (padding:    AllReduce of
                                   (DTensor's)     the reduction's identity)       the result
    mean                           S(0) -> P       sum of the real rows / T        AllReduce
    cumsum (fp32, fp64, integers)  S(0) -> S(0)    scan of the real rows + the     AllGather of
                                                   totals of the shards before     1 row per rank
    shift by k (a slice and a cat  S(0) -> S(0)    the shard after the k rows      AllGather of
    or a pad; `token_shifts`)                      before it (after it, k < 0)     k rows per rank
    roll by k                      S(0) -> S(0)    a shift by k whose outside      2 AllGathers of
                                                   rows are the wrapped ones       k rows per rank
    keyed sum (index_add,          (P, S(0), S(0)) the rank's rows into the whole  AllReduce of
    scatter_add, scatter_reduce    -> P            output, self on rank 0 (padding the result
    "sum"; `include_self`)                         rows: key 0, the identity)
    keyed amax, amin               (R, S(0), S(0)) the same, self on every rank    AllReduce of
    (scatter_reduce, index_reduce) -> P(max/min)                                   the result
    a replicated value at the      (R, S(0))       the rows of the shard's keys    none
    tokens' keys (`v[slot_T]`)     -> S(0)         (padding rows: key 0)
    one token's row at a computed  (S(0), R) -> P  the row if the rank holds it,   AllReduce of
    index (`x[top_1]`, `x[-1]`)                    else zeros                      one row
    rows written at computed       (S(0), R, R)    the rows the rank holds; the    none
    indices (`x[top] = v`,         -> S(0)         others to a scratch row
    `index_copy` along the tokens)
    any other (sort, var, cummax,  R -> R          the op on every row             AllGather of
    a gather by index, a conv, a   (gathered)                                      the value
    keyed mean, an ATen op DTensor
    has no rule for...)

Along another dim than the tokens, `cat` / `stack` of token shards with replicated pieces (a
value made before the layout shards the tokens beside one made after) split the replicated
pieces by a local slice: (R, S(0)) -> S(0), no exchange.

The exchanges are `spmd.transitions`' (`edge_rows`, `totals_before`); the all-reduces are its
`P -> R` row, which `insert` puts where a partial without a token dim is used. A partial sum
in a dtype the model sums more precisely than its partials (bf16) is not made: the op gathers.
The same ops on replicated values (every rank holds all T rows, as in attention) run as on one
device; a roll along the tokens becomes an `index_select` by `(t - k) mod T`, which every
target compiles for a symbolic T (the targets' own decompositions of `roll` branch on T = 0).

`localize` calls `localize_token_ops` for the per-rank forms: the masking of the padding rows
of every partial over the tokens, and the ops above.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch.distributed.tensor import Partial, Placement, Replicate
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import Argument

from dsv41_compile.core.errors import as_node
from dsv41_compile.core.meta import GLOBAL_VAL, IN, OUT, REAL_ROWS, tensor_inputs
from dsv41_compile.core.torch_private import custom_op_overload
from dsv41_compile.spmd.rules.registry import is_token_shard
from dsv41_compile.spmd.token_dims import (
    KEYED,
    TOKENS,
    global_value,
    reduced_dims,
    roll_dims,
    shift_tokens,
)
from dsv41_compile.spmd.transitions import (
    TokenSizes,
    edge_rows,
    mark_inserted,
    rows_at,
    totals_before,
)

__all__ = ["localize_token_ops", "shift_tokens"]  # shift_tokens: `spmd.token_dims`

aten = torch.ops.aten


# -- per-rank forms ---------------------------------------------------------------------------


def localize_token_ops(gm: GraphModule, sizes: TokenSizes) -> None:
    """Rewrite the ops along the token dim into their per-rank forms (the module docstring):
    each op by its form in `_FORMS`; any other op whose output is a partial over the tokens
    gets its padding rows masked."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function":
            form = _FORMS.get(node.target, _masked)
            form(graph, node, node.meta.get(OUT), sizes)


Form = Callable[[Graph, Node, Placement | None, TokenSizes], object]
"""An op's per-rank form: rewrites `node` (placed `out`) in `graph`; what it returns is not
used (`_masked`: whether it masked)."""


def _masked(graph: Graph, node: Node, out: Placement | None, sizes: TokenSizes) -> bool:
    """A partial over the tokens: its padding rows masked (any op's form, first)."""
    if type(out) is Partial:
        _mask_padding(graph, node, out, sizes)
        return True
    return False


def _index_form(graph: Graph, node: Node, out: Placement | None, sizes: TokenSizes) -> None:
    placed = node.meta.get(IN)
    if placed == (TOKENS, Replicate()):
        _rows_held(graph, node, sizes)  # a partial of rows, not of a reduction
    elif not _masked(graph, node, out, sizes) and placed == (Replicate(), TOKENS):
        _index_real_rows(graph, node, sizes)


def _mean_form(graph: Graph, node: Node, out: Placement | None, sizes: TokenSizes) -> None:
    if isinstance(out, Partial):
        _masked(graph, _mean_as_sum(graph, node, sizes), out, sizes)


def _cumsum_form(graph: Graph, node: Node, out: Placement | None, sizes: TokenSizes) -> None:
    if not _masked(graph, node, out, sizes) and out == TOKENS:
        _scan(graph, node, sizes)


def _roll_form(graph: Graph, node: Node, out: Placement | None, sizes: TokenSizes) -> None:
    if not _masked(graph, node, out, sizes) and 0 in roll_dims(node):
        _roll_tokens(graph, node, out, sizes)


def _shift_form(graph: Graph, node: Node, out: Placement | None, sizes: TokenSizes) -> None:
    if not _masked(graph, node, out, sizes):
        _shift_tokens(graph, node, sizes)


def _write_form(graph: Graph, node: Node, out: Placement | None, sizes: TokenSizes) -> None:
    if not _masked(graph, node, out, sizes) and node.meta.get(IN, (None,))[0] == TOKENS:
        _write_rows_held(graph, node, sizes)


def _identity(reduce_op: str, dtype: torch.dtype) -> bool | int | float:
    """The value a padding row takes in a reduction: the reduction's identity."""
    if reduce_op == "sum":
        return False if dtype is torch.bool else 0
    if dtype.is_floating_point:
        return float("-inf") if reduce_op == "max" else float("inf")
    if dtype is torch.bool:
        return reduce_op == "min"
    info = torch.iinfo(dtype)
    return info.min if reduce_op == "max" else info.max


def _real_rows(
    graph: Graph, x: Node, fill: bool | int | float, sizes: TokenSizes, site: Node
) -> Node:
    """`x` (a token shard) with its padding rows set to `fill`."""
    ndim = global_value(x).dim()
    mask = sizes.row_mask(graph)
    shaped = graph.call_function(aten.view.default, (mask, [-1] + [1] * (ndim - 1)))
    kept = graph.call_function(aten.where.ScalarOther, (shaped, x, fill))
    why = "padding rows out of an op across the tokens (their identity in it)"
    mark_inserted([shaped, kept], why, site)
    kept.meta[OUT] = TOKENS
    kept.meta[REAL_ROWS] = True
    return kept


def _mask_padding(graph: Graph, node: Node, out: Partial, sizes: TokenSizes) -> None:
    """A partial over the tokens reads the real rows only: its token-sharded inputs' padding
    rows are the identity of its reduction (they are whatever the ops before left there)."""
    for producer, need in zip(tensor_inputs(node), node.meta.get(IN, ())):
        if need != TOKENS or not is_token_shard(producer, need):
            continue
        with graph.inserting_before(node):
            dtype = global_value(producer).dtype
            # a keyed reduction's index: any row of the output (the source row is the identity)
            keyed = node.target in KEYED and producer is node.args[2]
            fill = 0 if keyed else _identity(out.reduce_op, dtype)
            kept = _real_rows(graph, producer, fill, sizes, node)
        node.replace_input_with(producer, kept)


def _index_real_rows(graph: Graph, node: Node, sizes: TokenSizes) -> None:
    """Rows at a token shard's indices: its padding rows (whatever the ops before left
    there, perhaps out of range) read row 0, and are padding of the result."""
    index = cast(Sequence[Node], node.args[1])[0]
    with graph.inserting_before(node):
        kept = _real_rows(graph, index, 0, sizes, node)
    node.replace_input_with(index, kept)


def _held(graph: Graph, index: Node, sizes: TokenSizes) -> tuple[Node, Node, list[Node]]:
    """A global token index (negative: from the end) as a row of this rank's shard, and
    whether this rank holds it."""
    wrapped = graph.call_function(aten.remainder.Scalar, (index, sizes.T))
    local = graph.call_function(aten.sub.Tensor, (wrapped, sizes.first_row(graph)))
    low = graph.call_function(aten.ge.Scalar, (local, 0))
    high = graph.call_function(aten.lt.Scalar, (local, sizes.Tl))
    mine = graph.call_function(aten.logical_and.default, (low, high))
    return local, mine, [wrapped, local, low, high, mine]


def _rows_held(graph: Graph, node: Node, sizes: TokenSizes) -> None:
    """`x[index]` of a token shard at replicated token indices: the rows this rank holds,
    zeros for the others (a partial sum: one rank holds each row)."""
    x, (index,) = node.args[0], cast(Sequence[Node], node.args[1])
    ndim = global_value(as_node(x, "an index's value")).dim()
    with graph.inserting_before(node):
        local, mine, added = _held(graph, index, sizes)
        safe = graph.call_function(aten.where.ScalarOther, (mine, local, 0))
        rows = graph.call_function(aten.index.Tensor, (x, [safe]))
        shape = list(global_value(index).shape) + [1] * (ndim - 1)
        held = graph.call_function(aten.view.default, (mine, shape))
        out = graph.call_function(aten.where.ScalarOther, (held, rows, 0))
    added += [safe, rows, held, out]
    mark_inserted(added, f"{node.name}: the rows at the indices this rank holds", node)
    out.meta.update({IN: node.meta[IN], OUT: Partial(), GLOBAL_VAL: node.meta[GLOBAL_VAL]})
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _write_rows_held(graph: Graph, node: Node, sizes: TokenSizes) -> None:
    """`index_put(x, [index], values)` (or `index_copy(x, 0, index, values)`) of a token shard
    at replicated token indices: the rows this rank holds written, the others' written to a
    scratch row past the shard."""
    if node.target is aten.index_copy.default:
        x, _, index, values = node.args
        rest: list[Argument] = []
    else:
        x, indices, values, *rest = node.args
        (index,) = cast(Sequence[Node], indices)
    index = as_node(index, "a write's index")
    ndim = global_value(as_node(x, "an index_put's value")).dim()
    with graph.inserting_before(node):
        local, mine, added = _held(graph, index, sizes)
        at = graph.call_function(aten.where.ScalarOther, (mine, local, sizes.Tl))
        scratch = [0, 0] * (ndim - 1) + [0, 1]
        padded = graph.call_function(aten.constant_pad_nd.default, (x, scratch))
        written = graph.call_function(aten.index_put.default, (padded, [at], values, *rest))
        out = graph.call_function(aten.slice.Tensor, (written, 0, 0, sizes.Tl))
    added += [at, padded, written, out]
    mark_inserted(added, f"{node.name}: the rows this rank holds written", node)
    out.meta.update({IN: node.meta[IN], OUT: TOKENS, GLOBAL_VAL: node.meta[GLOBAL_VAL]})
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _mean_as_sum(graph: Graph, node: Node, sizes: TokenSizes) -> Node:
    """`mean(x, dims)` over the token dim -> `sum(x, dims) / (T * the other reduced sizes)`:
    each rank's share of the mean, summed by the AllReduce."""
    x = as_node(node.args[0], "a token op's argument")
    dims = reduced_dims(node)
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    count: Node = sizes.T
    shape = global_value(x).shape
    others = 1
    for d in dims:
        if d != 0:
            others *= int(shape[d])
    with graph.inserting_before(node):
        kwargs = {"dtype": node.kwargs["dtype"]} if node.kwargs.get("dtype") else {}
        summed = graph.call_function(aten.sum.dim_IntList, (x, dims, keepdim), kwargs)
        added = [summed]
        if others != 1:
            count = graph.call_function(operator.mul, (sizes.T, others))
            added.append(count)
        share = graph.call_function(aten.div.Tensor, (summed, count))
        added.append(share)
    mark_inserted(added, f"{node.name}: the mean over the tokens, as a sum / T", node)
    summed.meta.update({IN: node.meta[IN], OUT: Partial(), GLOBAL_VAL: node.meta[GLOBAL_VAL]})
    share.meta.update({IN: (Partial(),), OUT: Partial(), GLOBAL_VAL: node.meta[GLOBAL_VAL]})
    node.replace_all_uses_with(share)
    graph.erase_node(node)
    return summed


def _reason(node: Node, what: str, why: str) -> str:
    """A collective's reason: what it exchanges, for which op (named with its model line in
    `graph.py`'s list of extra collectives), and why it beats gathering the value."""
    return f"{what} for {node.name} on token shards: {why}"


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def _scan(graph: Graph, node: Node, sizes: TokenSizes) -> None:
    """`cumsum(x, 0)` of a token shard: the shard's scan (padding rows 0) plus the sum of the
    shards before it."""
    x = as_node(node.args[0], "a token op's argument")
    dtype = node.kwargs.get("dtype")
    with graph.inserting_before(node):
        kept = _real_rows(graph, x, 0, sizes, node)
        kwargs: dict[str, Argument] = {"dtype": dtype} if dtype is not None else {}
        total = graph.call_function(aten.sum.dim_IntList, (kept, [0], True), kwargs)
    node.replace_input_with(x, kept)
    with graph.inserting_before(node.next):
        exchanged = totals_before(graph, total, global_value(node).dim(), sizes)
        scanned = graph.call_function(aten.add.Tensor, (node, exchanged[-1]))
    why = _reason(
        node,
        "shard totals",
        "a cumulative sum adds the totals of the shards before each: 1 row per rank, where "
        "gathering the value would move T rows",
    )
    mark_inserted([total, *exchanged, scanned], why, node)
    node.replace_all_uses_with(scanned, delete_user_cb=lambda user: user is not scanned)
    _move_placement(node, scanned)


def _move_placement(node: Node, to: Node) -> None:
    """`to` takes `node`'s place in the placed graph: its placement and global value."""
    for key in (OUT, GLOBAL_VAL):
        if key in node.meta:
            to.meta[key] = node.meta.pop(key)
    node.meta[OUT] = None


def _roll_tokens(graph: Graph, node: Node, out: Placement | None, sizes: TokenSizes) -> None:
    """`roll(x, shifts, dims)` with the token dim among `dims`: the token dim's roll on a
    replicated value as an index by `(t - k) mod T`; on a token shard as a shift by k whose
    outside rows are the wrapped rows (`(j - k) mod T`), fetched from the ranks that hold them."""
    x, shifts, dims = (
        as_node(node.args[0], "a token op's argument"),
        list(cast(Sequence[int], node.args[1])),
        roll_dims(node),
    )
    k = shifts[dims.index(0)]
    rest = [(s, d) for s, d in zip(shifts, dims) if d != 0]
    with graph.inserting_before(node):
        if out == TOKENS:
            nodes = _rolled_shard(graph, x, k, sizes, node)
        else:
            nodes = _rolled_rows(graph, x, k, sizes)
            mark_inserted(nodes, f"{node.name}: a roll along the tokens, as an index", node)
        if rest:
            others = [s for s, _ in rest], [d for _, d in rest]
            nodes.append(graph.call_function(aten.roll.default, (nodes[-1], *others)))
            mark_inserted(nodes[-1:], f"{node.name}: the roll along the other dims", node)
    node.replace_all_uses_with(nodes[-1])
    _move_placement(node, nodes[-1])
    graph.erase_node(node)


def _modulo_tokens(graph: Graph, index: Node, sizes: TokenSizes) -> list[Node]:
    """`index mod max(T, 1)` (no rows to index at T = 0: any modulus will do)."""
    count = graph.call_function(torch.sym_max, (sizes.T, 1))
    return [count, graph.call_function(aten.remainder.Scalar, (index, count))]


def _rolled_rows(graph: Graph, x: Node, k: int, sizes: TokenSizes) -> list[Node]:
    steps = graph.call_function(
        aten.arange.default, (sizes.T,), {"dtype": torch.int64, "device": sizes.device}
    )
    back = graph.call_function(aten.sub.Tensor, (steps, k))
    wrapped = _modulo_tokens(graph, back, sizes)
    rows = graph.call_function(aten.index_select.default, (x, 0, wrapped[-1]))
    return [steps, back, *wrapped, rows]


def _rolled_shard(graph: Graph, x: Node, k: int, sizes: TokenSizes, site: Node) -> list[Node]:
    g = graph
    n = abs(k)
    steps = g.call_function(
        aten.arange.default, (n,), {"dtype": torch.int64, "device": sizes.device}
    )
    # the outside rows: before the first (k > 0) x[(j - k) mod T], after the last x[j mod T]
    source = g.call_function(aten.sub.Tensor, (steps, k)) if k > 0 else steps
    wrapped = _modulo_tokens(g, source, sizes)
    fetched = rows_at(g, x, wrapped[-1], n, sizes)
    why = _reason(
        site,
        "wrapped rows",
        f"a roll by {k} brings {_rows(n)} around from the other end, from the ranks that hold "
        f"them: {_rows(n)} per rank, where gathering the value would move T rows",
    )
    mark_inserted([steps, *([source] if k > 0 else []), *wrapped, *fetched], why, site)
    shifted = _shifted_shard(g, x, k, fetched[-1], sizes, site)
    return [steps, *([source] if k > 0 else []), *wrapped, *fetched, *shifted]


def _shifted_shard(
    graph: Graph, x: Node, k: int, outside: Node, sizes: TokenSizes, site: Node
) -> list[Node]:
    """Rank r's rows of `shift_tokens(x, k, outside)` for a token shard `x`."""
    g, n = graph, abs(k)
    edge = edge_rows(g, x, n, outside, sizes, before=k > 0)
    why = _reason(
        site,
        "neighbour rows",
        f"a shift by {k} needs the {_rows(n)} {'before' if k > 0 else 'after'} each shard: "
        f"{_rows(n)} per rank, where gathering the value would move T rows",
    )
    mark_inserted(edge, why, site)
    if k > 0:
        joined = g.call_function(aten.cat.default, ([edge[-1], x],))
        rows = g.call_function(aten.slice.Tensor, (joined, 0, 0, sizes.Tl))
        nodes = [joined, rows]
    else:
        joined = g.call_function(aten.cat.default, ([x, edge[-1]],))
        end = g.call_function(operator.add, (sizes.Tl, n))
        rows = g.call_function(aten.slice.Tensor, (joined, 0, n, end))
        # the rows whose source is past the last token take `outside`'s rows
        past = g.call_function(aten.sub.Tensor, (sizes.local_rows(g), sizes.T))
        past = g.call_function(aten.add.Tensor, (past, n))
        over = g.call_function(aten.ge.Scalar, (past, 0))
        at = g.call_function(aten.clamp.default, (past, 0, n - 1))
        tail = g.call_function(aten.index_select.default, (outside, 0, at))
        ndim = global_value(x).dim()
        shaped = g.call_function(aten.view.default, (over, [-1] + [1] * (ndim - 1)))
        fixed = g.call_function(aten.where.self, (shaped, tail, rows))
        nodes = [joined, end, rows, past, over, at, tail, shaped, fixed]
    mark_inserted(nodes, f"{site.name}: this rank's rows of the shift", site)
    return [*edge, *nodes]


def _shift_tokens(graph: Graph, node: Node, sizes: TokenSizes) -> None:
    x, k, outside = node.args
    with graph.inserting_before(node):
        nodes = _shifted_shard(
            graph,
            as_node(x, "a token op's argument"),
            cast(int, k),
            as_node(outside, "a token op's argument"),
            sizes,
            node,
        )
    node.replace_all_uses_with(nodes[-1])
    _move_placement(node, nodes[-1])
    graph.erase_node(node)


_FORMS: dict[object, Form] = {
    aten.index.Tensor: _index_form,
    aten.mean.dim: _mean_form,
    aten.mean.default: _mean_form,
    aten.cumsum.default: _cumsum_form,
    aten.roll.default: _roll_form,
    custom_op_overload(shift_tokens): _shift_form,
    aten.index_put.default: _write_form,
    aten.index_copy.default: _write_form,
}
"""The per-rank form of each op along the token dim, by op (`localize_token_ops`)."""
