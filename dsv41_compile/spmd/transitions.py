"""The transition table: every placement change on the tp axis and the graph nodes that do it,
and the exchanges an op on token shards makes. No collective is chosen anywhere else.

    src   -> dst    what                                                    communication
    S(0)  -> R      all_gather_into_tensor + wait, split off the tail padding AllGather(tp)
    S(d)  -> R      d > 0, a static dim split evenly (a vocab-sharded head's  AllGather(tp)
                    logits): gather, move the ranks' blocks to dim d
    P     -> S(0)   pad the token dim to tp*Tl, reduce_scatter_tensor(sum)  ReduceScatter(tp)
    R     -> S(d)   pad, view as [tp, n/tp] on dim d, take row tp_rank      none
    P     -> R      all_reduce(sum, max or min) + wait: the replicated       AllReduce(tp)
                    baseline's partials, and statistics over the tokens
    R     -> P      rank 0's copy, zeros elsewhere: a replicated addend of   none
                    a partial sum (a bias of a row-parallel projection)
    S(1)  -> S(0)   pad the token dim, all_to_all_single, regroup columns   AllToAll(tp)
                    (a 2-D value: [T, W/tp] -> [Tl, W]; sp's exit all-to-all)
    S(a)  -> S(b)   any other: an error that says how to add the row         (error)

    exchange        what an op on token shards needs                        communication
    edge rows       the k rows before (or after) each shard: a shift or a   AllGather(tp) of
                    roll along the tokens (`edge_rows`)                      k rows per rank
    shard totals    the sum of each shard: a cumulative sum along the       AllGather(tp) of
                    tokens adds the totals of the shards before it           one row per rank
    rows at         k rows at given token indices: the rows a roll along    AllGather(tp) of
                    the tokens brings around from the other end              k rows per rank

Which of P -> S(0) and P -> R runs for a value with a token dim is the plan's choice
(`ShardingPlan.partial_to`): a partial sum goes there first, whatever its consumer needs (in `sp`
a consumer needing it replicated gets it reduce-scattered, then gathered); a partial without a
token dim (a sum over the tokens) is all-reduced.

Token shards are contiguous chunks of Tl = ceil(T/tp) rows of the token dim (dim 0), with
padding only at the global tail (torch.chunk / DTensor `Shard` order). Padding rows are zeros
(False for masks) where a transition makes them: the model's `valid` mask is False there, so
they are routed nowhere and dropped at exit. An op may leave anything in them; an op that
reads across rows never reads them (`TokenSizes.row_mask`: a reduction over the tokens sets
them to its identity, an exchange sends real rows). The one exception is a routing table
sliced for a routed-experts op (the replicated baseline's token owners): its padding rows are
the op's "routed nowhere" value (`pad_value`). A `Shard(0)` of a value whose dim 0 is not the
token count (a statistic's [D] features, a weight's rows) is an even split of a static size.
The graph is the same on every rank: the rank enters as the `tp_rank` input, never as a constant.
Each row of the table is one function registered with `@transition`; a model family or a layout
adds a row the same way.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.fx import Graph, Node

from dsv41_compile.core.adapter import ModelAdapter
from dsv41_compile.core.meta import GLOBAL_VAL, OUT, REASON, REGION, SYMBOL, describe
from dsv41_compile.core.placements import format_placement
from dsv41_compile.core.registry import Registry
from dsv41_compile.core.symbols import is_token_count

__all__ = [
    "TRANSITIONS",
    "TokenSizes",
    "Transition",
    "edge_rows",
    "mark_inserted",
    "redistribute",
    "rows_at",
    "totals_before",
    "transition",
]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclass
class TokenSizes:
    """Graph nodes for the token count T (the length of `input_ids`), the shard length
    Tl = ceil(T/tp), the padding Tpad - T, and the `tp_rank` input; created once after the
    placeholders."""

    T: Node
    Tl: Node
    pad: Node
    tp_rank: Node
    tp: int
    group_name: str
    device: torch.device = torch.device("cpu")
    _rows: dict[str, Node] | None = None

    def first_row(self, graph: Graph) -> Node:
        """`tp_rank * Tl`: the global index of this rank's first row (made once)."""
        return self._made(graph)["first"]

    def row_mask(self, graph: Graph) -> Node:
        """`[Tl]` bool: which of this rank's rows are real tokens, `first_row + i < T` (made
        once): what keeps the padding rows out of a reduction or an exchange."""
        return self._made(graph)["mask"]

    def local_rows(self, graph: Graph) -> Node:
        """`[Tl]` int64: the global index of each of this rank's rows (made once)."""
        return self._made(graph)["rows"]

    def _made(self, graph: Graph) -> dict[str, Node]:
        if self._rows is None:
            nodes = []
            with graph.inserting_after(self.pad):
                step = graph.call_function(
                    aten.arange.default, (self.Tl,), {"dtype": torch.int64, "device": self.device}
                )
                nodes.append(step)
            with graph.inserting_after(step):
                first = graph.call_function(aten.mul.Tensor, (self.tp_rank, self.Tl))
            with graph.inserting_after(first):
                rows = graph.call_function(aten.add.Tensor, (step, first))
            with graph.inserting_after(rows):
                mask = graph.call_function(aten.lt.Scalar, (rows, self.T))
            for n, why in (
                (step, "0 .. Tl-1"),
                (first, "this rank's first row: tp_rank * Tl"),
                (rows, "the global index of this rank's rows"),
                (mask, "this rank's real rows (not tail padding): index < T"),
            ):
                n.meta[REASON] = why
                n.meta[OUT] = None
            self._rows = {"first": first, "rows": rows, "mask": mask}
        return self._rows

    @staticmethod
    def create(graph: Graph, token_input: Node, tp: int, group_name: str) -> TokenSizes:
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        with graph.inserting_after(placeholders[-1]):
            tp_rank = graph.placeholder("tp_rank")
        with graph.inserting_after(tp_rank):
            T = graph.call_function(aten.sym_size.int, (token_input, 0))
        with graph.inserting_after(T):
            up = graph.call_function(operator.add, (T, tp - 1))
        with graph.inserting_after(up):
            Tl = graph.call_function(operator.floordiv, (up, tp))
        with graph.inserting_after(Tl):
            Tpad = graph.call_function(operator.mul, (Tl, tp))
        with graph.inserting_after(Tpad):
            pad = graph.call_function(operator.sub, (Tpad, T))
        for n, why in ((T, "T"), (Tl, "Tl = ceil(T/tp)"), (Tpad, "tp*Tl"), (pad, "tp*Tl - T")):
            n.meta[REASON] = why
        T.meta[SYMBOL] = "T"
        tp_rank.meta[REASON] = "this rank's index in its TP group"
        for n in (tp_rank, T, up, Tl, Tpad, pad):
            n.meta[OUT] = None
        device = token_input.meta["val"].device
        return TokenSizes(T, Tl, pad, tp_rank, tp, group_name, device)


def pad_value(consumer: Node, position: int, adapter: ModelAdapter) -> int:
    """The value of the padding rows of the `position`-th tensor input of `consumer`: a routed-
    experts op's own value for "no assignment" in its top-k ids (a padding row is routed
    nowhere), else 0."""
    spec = adapter.routed_experts_op(consumer.target)
    return spec.pad_value(position) if spec is not None else 0


def _pad_tokens(graph: Graph, value: Node, ndim: int, sizes: TokenSizes, fill: int = 0) -> Node:
    # constant_pad_nd pads from the last dim backwards: the last pair is dim 0's (before, after).
    return graph.call_function(
        aten.constant_pad_nd.default, (value, [0, 0] * (ndim - 1) + [0, sizes.pad], fill)
    )


Transition = Callable[[Graph, Node, Placement, Placement, TokenSizes, int], list[Node]]
"""`emit(graph, value, src, dst, sizes, fill) -> nodes`: the nodes turning `value` (placed
`src`) into `dst`, the last one the new value; padding rows are `fill`."""

TRANSITIONS: Registry[tuple[Callable[[Placement, Placement], bool], Transition]] = Registry(
    "transition"
)
"""(applies, emit) by the emitting function's qualified name, in registration order."""


_Emit = TypeVar("_Emit", bound=Callable[..., list[Node]])
"""A transition's emitter, its `src` and `dst` typed as narrowly as `applies` admits."""


def transition(
    applies: Callable[[Placement, Placement], bool],
) -> Callable[[_Emit], _Emit]:
    """Register a transition for the placement changes `applies(src, dst)` accepts; the first
    registered one that applies is used (docs/architecture.md, "Adding a transition"). One
    registration per function (by its module and qualified name)."""

    def register(emit: _Emit) -> _Emit:
        TRANSITIONS.add(f"{emit.__module__}.{emit.__qualname__}", (applies, emit))
        return emit

    return register


def _is_token_shard(p: Placement) -> bool:
    return isinstance(p, Shard) and p.dim == 0


def _is_sum(p: Placement) -> bool:
    return isinstance(p, Partial) and p.reduce_op == "sum"


def _global(value: Node) -> torch.Tensor:
    """The value's global fake tensor (before localization)."""
    return cast(torch.Tensor, value.meta.get(GLOBAL_VAL, value.meta.get("val")))


def _tokens_on(value: Node, dim: int) -> bool:
    """Whether dim `dim` of `value` is the token dim (its size is T, padded per rank), not a
    static size split evenly."""
    return is_token_count(_global(value).shape[dim])


@transition(lambda src, dst: _is_token_shard(src) and isinstance(dst, Replicate))
def _all_gather(graph: Graph, value: Node, src, dst, sizes: TokenSizes, fill: int) -> list[Node]:
    gathered = graph.call_function(
        c10d.all_gather_into_tensor.default, (value, sizes.tp, sizes.group_name)
    )
    waited = graph.call_function(c10d.wait_tensor.default, (gathered,))
    if not _tokens_on(value, 0):  # an even split of a static size: nothing to drop
        return [gathered, waited]
    # split (not slice) into [T, pad]: the sizes add up to the gathered size exactly, which
    # compilers can see even when T is an unbacked symbol.
    parts = graph.call_function(aten.split_with_sizes.default, (waited, [sizes.T, sizes.pad]))
    return [gathered, waited, parts, graph.call_function(operator.getitem, (parts, 0))]


@transition(lambda src, dst: isinstance(src, Shard) and src.dim > 0 and isinstance(dst, Replicate))
def _all_gather_columns(
    graph: Graph, value: Node, src: Shard, dst, sizes: TokenSizes, fill: int
) -> list[Node]:
    """An even split of a static dim d > 0 (a vocab-sharded head's `[R, V/tp]` logits) made
    whole: one AllGather (which stacks the ranks' blocks on dim 0), the blocks moved to dim d
    in rank order, the result made dense."""
    val, d = _global(value), src.dim
    if _tokens_on(value, d):
        raise NotImplementedError(
            f"{describe(value)}: its token dim {d} is sharded; only a static dim is gathered here"
        )
    if not all(isinstance(n, int) for n in val.shape[1:]):
        raise NotImplementedError(
            f"{describe(value)}: gathering dim {d} needs the dims after the first static"
        )
    gathered = graph.call_function(
        c10d.all_gather_into_tensor.default, (value, sizes.tp, sizes.group_name)
    )
    waited = graph.call_function(c10d.wait_tensor.default, (gathered,))
    blocks = graph.call_function(aten.unflatten.int, (waited, 0, [sizes.tp, -1]))
    moved = graph.call_function(aten.movedim.int, (blocks, 0, d))
    dense = graph.call_function(
        aten.clone.default, (moved,), {"memory_format": torch.contiguous_format}
    )
    out = graph.call_function(aten.view.default, (dense, [-1, *val.shape[1:]]))
    return [gathered, waited, blocks, moved, dense, out]


@transition(lambda src, dst: _is_sum(src) and _is_token_shard(dst))
def _reduce_scatter(
    graph: Graph, value: Node, src, dst, sizes: TokenSizes, fill: int
) -> list[Node]:
    nodes = []
    if _tokens_on(value, 0):
        value = _pad_tokens(graph, value, _global(value).dim(), sizes)
        nodes.append(value)
    scattered = graph.call_function(
        c10d.reduce_scatter_tensor.default, (value, "sum", sizes.tp, sizes.group_name)
    )
    return [*nodes, scattered, graph.call_function(c10d.wait_tensor.default, (scattered,))]


_ALL_REDUCE_OPS = ("sum", "max", "min")


@transition(
    lambda src, dst: (
        isinstance(src, Partial) and src.reduce_op in _ALL_REDUCE_OPS and isinstance(dst, Replicate)
    )
)
def _all_reduce(
    graph: Graph, value: Node, src: Partial, dst, sizes: TokenSizes, fill: int
) -> list[Node]:
    reduced = graph.call_function(c10d.all_reduce.default, (value, src.reduce_op, sizes.group_name))
    return [reduced, graph.call_function(c10d.wait_tensor.default, (reduced,))]


@transition(lambda src, dst: isinstance(src, Replicate) and _is_sum(dst))
def _rank_zero_share(
    graph: Graph, value: Node, src, dst, sizes: TokenSizes, fill: int
) -> list[Node]:
    """A replicated addend of a partial sum counts once: rank 0 holds it, the others zeros
    (exact, where DTensor's R -> P divides by tp)."""
    first = graph.call_function(aten.eq.Scalar, (sizes.tp_rank, 0))
    return [first, graph.call_function(aten.where.ScalarOther, (first, value, 0))]


@transition(lambda src, dst: src == Shard(1) and _is_token_shard(dst))
def _all_to_all(graph: Graph, value: Node, src, dst, sizes: TokenSizes, fill: int) -> list[Node]:
    """`[T, W/tp]` (this rank's columns of every token) -> `[Tl, W]` (every column of its
    tokens): chunk j of the padded rows goes to rank j, and the chunk from rank j holds rank
    j's columns, which take their place in column order."""
    val = value.meta["val"]
    if val.dim() != 2:
        raise NotImplementedError(
            f"{describe(value)}: the S(1) -> S(0) all-to-all moves 2-D values, got {val.dim()}-D"
        )
    padded = _pad_tokens(graph, value, 2, sizes, fill)
    splits = [sizes.Tl] * sizes.tp
    sent = graph.call_function(
        c10d.all_to_all_single.default, (padded, splits, splits, sizes.group_name)
    )
    waited = graph.call_function(c10d.wait_tensor.default, (sent,))
    blocks = graph.call_function(aten.unflatten.int, (waited, 0, [sizes.tp, sizes.Tl]))
    by_token = graph.call_function(aten.permute.default, (blocks, [1, 0, 2]))
    dense = graph.call_function(
        aten.clone.default, (by_token,), {"memory_format": torch.contiguous_format}
    )
    # the value's global shape: W, which this rank now holds whole
    out = graph.call_function(aten.view.default, (dense, [sizes.Tl, val.shape[1]]))
    return [padded, sent, waited, blocks, by_token, dense, out]


@transition(lambda src, dst: isinstance(src, Replicate) and isinstance(dst, Shard))
def _local_slice(
    graph: Graph, value: Node, src, dst: Shard, sizes: TokenSizes, fill: int
) -> list[Node]:
    val, d, tp = _global(value), dst.dim, sizes.tp
    nodes = []
    if _tokens_on(value, d):  # the token dim: padded to tp*Tl rows, Tl per rank
        if d != 0:
            raise NotImplementedError(
                f"{describe(value)}: its token dim is dim {d}; token shards are on dim 0"
            )
        value = _pad_tokens(graph, value, val.dim(), sizes, fill)
        nodes.append(value)
        chunk: Node | int = sizes.Tl
    elif d == 0 and not isinstance(val.shape[0], int):
        # a dim the rules took for T rows (T for T >= 1: one row at T = 0, as `x[:-1]` and
        # one row make): padded -- or cropped -- to tp*Tl from its own size
        rows = graph.call_function(aten.sym_size.int, (value, 0))
        padded = graph.call_function(operator.mul, (sizes.Tl, tp))
        amount = graph.call_function(operator.sub, (padded, rows))
        dims = [0, 0] * (val.dim() - 1) + [0, amount]
        value = graph.call_function(aten.constant_pad_nd.default, (value, dims, fill))
        nodes += [rows, padded, amount, value]
        chunk = sizes.Tl
    else:
        size = val.shape[d]
        chunk = size // tp if isinstance(size, int) else -1
    # explicit chunk sizes: a -1 next to a symbolic dim is not always inferable
    split = graph.call_function(aten.unflatten.int, (value, d, [tp, chunk]))
    out = graph.call_function(aten.index.Tensor, (split, [None] * d + [sizes.tp_rank]))
    return [*nodes, split, out]


def redistribute(
    graph: Graph,
    value: Node,
    src: Placement,
    dst: Placement,
    sizes: TokenSizes,
    *,
    site: Node,
    why: str,
    fill: int = 0,
    choice: str | None = None,
) -> Node:
    """Nodes turning `value` (placed `src`) into `dst`, inserted at the graph's current insert
    point by the first registered transition that applies; they carry the module and source
    line of `site` (the consumer, or the producer when the value leaves a module with an exit
    placement). Padding rows are `fill`; `choice`, a decision behind the transition (the
    adapter's cut), is added to its collectives' reason. Returns the new value."""
    if src == dst:
        return value
    emit = next((emit for applies, emit in TRANSITIONS.values() if applies(src, dst)), None)
    if emit is None:
        raise NotImplementedError(_no_transition(value, src, dst, why))
    nodes = emit(graph, value, src, dst, sizes, fill)
    reason = f"{format_placement(src)} -> {format_placement(dst)}: {why}"
    mark_inserted(nodes, reason, site, choice=choice)
    return nodes[-1]


def mark_inserted(nodes: list[Node], reason: str, site: Node, *, choice: str | None = None) -> None:
    """Inserted `nodes` carry `reason` (their collectives also `choice`, when given) and the
    module, source line and region of `site`."""
    for n in nodes:
        n.meta[REASON] = reason
        if choice is not None and getattr(n.target, "namespace", None) == "_c10d_functional":
            n.meta[REASON] += f"; {choice}"
        for key in ("stack_trace", "nn_module_stack", REGION):
            if key in site.meta:
                n.meta[key] = site.meta[key]


# -- Exchanges inside an op on token shards ---------------------------------------------------


def _gather_rows(graph: Graph, rows: Node, sizes: TokenSizes) -> list[Node]:
    gathered = graph.call_function(
        c10d.all_gather_into_tensor.default, (rows, sizes.tp, sizes.group_name)
    )
    return [gathered, graph.call_function(c10d.wait_tensor.default, (gathered,))]


def edge_rows(
    graph: Graph, shard: Node, k: int, outside: Node, sizes: TokenSizes, *, before: bool
) -> list[Node]:
    """Nodes giving the `k` rows of the padded token sequence just before this rank's shard
    (`before`) or just after it, `[k, ...]`; `outside` (`[k, ...]`, the shard's dtype) stands
    for the rows before the first shard or after the last one. One AllGather of k rows per
    rank: each rank sends the k rows at its edge, and a shard shorter than k (T < k*tp) sends
    all it has, so the k rows come from as many ranks as they span. The last node is the rows.

    Why not gather the value: a shift by k needs k rows of its neighbour, `k*tp` rows gathered
    against the `tp*Tl` rows of an AllGather of the value."""
    g, tl, tp = graph, sizes.Tl, sizes.tp
    nodes = [g.call_function(aten.zeros_like.default, (outside,))]
    if before:  # the last k rows of [zeros, shard]
        nodes.append(g.call_function(aten.cat.default, ([nodes[0], shard],)))
        nodes.append(g.call_function(operator.add, (tl, k)))
        nodes.append(g.call_function(aten.slice.Tensor, (nodes[1], 0, tl, nodes[2])))
    else:  # the first k rows of [shard, zeros]
        nodes.append(g.call_function(aten.cat.default, ([shard, nodes[0]],)))
        nodes.append(g.call_function(aten.slice.Tensor, (nodes[1], 0, 0, k)))
    nodes += _gather_rows(g, nodes[-1], sizes)
    # the rows of the sequence among a rank's k: all k, or its Tl when Tl < k
    m = g.call_function(torch.sym_min, (tl, k))
    by_rank = g.call_function(aten.unflatten.int, (nodes[-1], 0, [tp, k]))
    nodes += [m, by_rank]
    if before:
        nodes.append(g.call_function(operator.sub, (k, m)))
        nodes.append(g.call_function(aten.slice.Tensor, (by_rank, 1, nodes[-1], k)))
    else:
        nodes.append(g.call_function(aten.slice.Tensor, (by_rank, 1, 0, m)))
    sequence = g.call_function(aten.flatten.using_ints, (nodes[-1], 0, 1))
    extended = g.call_function(
        aten.cat.default, ([outside, sequence] if before else [sequence, outside],)
    )
    nodes += [sequence, extended]
    # this rank's k rows start at r*m of `extended` (before: `outside` comes first), or at
    # (r + 1)*m, where the next rank's begin (after)
    first = sizes.tp_rank
    if not before:
        first = g.call_function(aten.add.Tensor, (sizes.tp_rank, 1))
        nodes.append(first)
    nodes.append(g.call_function(aten.mul.Tensor, (first, m)))
    steps = g.call_function(
        aten.arange.default, (k,), {"dtype": torch.int64, "device": sizes.device}
    )
    nodes += [steps, g.call_function(aten.add.Tensor, (steps, nodes[-1]))]
    nodes.append(g.call_function(aten.index_select.default, (extended, 0, nodes[-1])))
    return nodes


def rows_at(graph: Graph, shard: Node, index: Node, k: int, sizes: TokenSizes) -> list[Node]:
    """Nodes giving the k rows of the token sequence at the global rows `index` (`[k]` int64,
    each < T): each rank sends the ones its shard holds and zeros for the others, one
    AllGather of k rows per rank, and the rows are the sum over the ranks (one holder each).
    The last node is the rows."""
    g = graph
    local = g.call_function(aten.sub.Tensor, (index, sizes.first_row(g)))
    low = g.call_function(aten.ge.Scalar, (local, 0))
    high = g.call_function(aten.lt.Scalar, (local, sizes.Tl))
    held = g.call_function(aten.bitwise_and.Tensor, (low, high))
    # a zero row after the shard, read for the rows this rank does not hold (and at T = 0)
    zero = g.call_function(aten.new_zeros.default, (shard, [1, *_global(shard).shape[1:]]))
    extended = g.call_function(aten.cat.default, ([shard, zero],))
    at = g.call_function(aten.where.ScalarOther, (held, local, sizes.Tl))
    mine = g.call_function(aten.index_select.default, (extended, 0, at))
    gathered = _gather_rows(g, mine, sizes)
    by_rank = g.call_function(aten.unflatten.int, (gathered[-1], 0, [sizes.tp, k]))
    rows = g.call_function(aten.sum.dim_IntList, (by_rank, [0]))
    return [local, low, high, held, zero, extended, at, mine, *gathered, by_rank, rows]


def totals_before(graph: Graph, total: Node, ndim: int, sizes: TokenSizes) -> list[Node]:
    """Nodes giving the sum of the shards before this rank's, from each rank's `total`
    (`[1, ...]`, `ndim` dims: its shard summed over the tokens): one AllGather of one row per
    rank, where gathering the value would move T rows. The last node is the sum."""
    gathered = _gather_rows(graph, total, sizes)
    ranks = graph.call_function(
        aten.arange.default, (sizes.tp,), {"dtype": torch.int64, "device": sizes.device}
    )
    earlier = graph.call_function(aten.lt.Tensor, (ranks, sizes.tp_rank))
    shape = [sizes.tp] + [1] * (ndim - 1)
    mask = graph.call_function(aten.view.default, (earlier, shape))
    kept = graph.call_function(aten.where.ScalarOther, (mask, gathered[-1], 0))
    summed = graph.call_function(aten.sum.dim_IntList, (kept, [0], True))
    return [*gathered, ranks, earlier, mask, kept, summed]


def _no_transition(value: Node, src: Placement, dst: Placement, why: str) -> str:
    if isinstance(src, Partial) and src.reduce_op not in _ALL_REDUCE_OPS:
        return f"{describe(value)}: only sum, max and min partials are reduced"
    return (
        f"{describe(value)}: no {format_placement(src)} -> {format_placement(dst)} transition "
        f'({why}). Add one (docs/architecture.md, "Adding a transition"), or change the plan '
        "or the consumer's rule so the value arrives as it is"
    )
