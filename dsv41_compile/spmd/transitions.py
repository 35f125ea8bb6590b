"""The transition table: every placement change on the tp axis and the graph nodes that do it.
No collective is chosen anywhere else.

    src   -> dst    what                                                    communication
    S(0)  -> R      all_gather_into_tensor + wait, split off the tail padding AllGather(tp)
    P     -> S(0)   pad the token dim to tp*Tl, reduce_scatter_tensor(sum)  ReduceScatter(tp)
    R     -> S(d)   pad, view as [tp, n/tp] on dim d, take row tp_rank      none
    P     -> R      all_reduce(sum) + wait (the replicated baseline only)   AllReduce(tp)
    S(1)  -> S(0)   pad the token dim, all_to_all_single, regroup columns   AllToAll(tp)
                    (a 2-D value: [T, W/tp] -> [Tl, W]; sp's exit all-to-all)
    S(a)  -> S(b)   any other                                               (error)
    R     -> P      never needed                                            (error)

Which of P -> S(0) and P -> R runs is the plan's choice (`ShardingPlan.partial_to`).

Token shards are contiguous chunks of Tl = ceil(T/tp) rows of the token dim, with padding only
at the global tail (torch.chunk / DTensor `Shard` order). Padding rows are zeros (False for
masks): the model's `valid` mask is False there, so they are routed nowhere and dropped at exit.
The one exception is a routing table sliced for a routed-experts op (the replicated baseline's
token owners): its padding rows are the op's "routed nowhere" value (`pad_value`).
The graph is the same on every rank: the rank enters as the `tp_rank` input, never as a constant.
Each row of the table is one function registered with `@transition`; a model family or a layout
adds a row the same way.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.fx import Graph, Node

from dsv41_compile.core.adapter import ModelAdapter
from dsv41_compile.core.meta import OUT, REASON, REGION, SYMBOL, describe
from dsv41_compile.core.placements import format_placement
from dsv41_compile.core.registry import Registry

__all__ = ["TRANSITIONS", "TokenSizes", "Transition", "redistribute", "transition"]

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
        return TokenSizes(T, Tl, pad, tp_rank, tp, group_name)


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


def transition(
    applies: Callable[[Placement, Placement], bool],
) -> Callable[[Transition], Transition]:
    """Register a transition for the placement changes `applies(src, dst)` accepts; the first
    registered one that applies is used (docs/architecture.md, "Adding a transition"). One
    registration per function (by its module and qualified name)."""

    def register(emit: Transition) -> Transition:
        TRANSITIONS.add(f"{emit.__module__}.{emit.__qualname__}", (applies, emit))
        return emit

    return register


def _is_token_shard(p: Placement) -> bool:
    return isinstance(p, Shard) and p.dim == 0


def _is_sum(p: Placement) -> bool:
    return isinstance(p, Partial) and p.reduce_op == "sum"


@transition(lambda src, dst: _is_token_shard(src) and isinstance(dst, Replicate))
def _all_gather(graph: Graph, value: Node, src, dst, sizes: TokenSizes, fill: int) -> list[Node]:
    gathered = graph.call_function(
        c10d.all_gather_into_tensor.default, (value, sizes.tp, sizes.group_name)
    )
    waited = graph.call_function(c10d.wait_tensor.default, (gathered,))
    # split (not slice) into [T, pad]: the sizes add up to the gathered size exactly, which
    # compilers can see even when T is an unbacked symbol.
    parts = graph.call_function(aten.split_with_sizes.default, (waited, [sizes.T, sizes.pad]))
    return [gathered, waited, parts, graph.call_function(operator.getitem, (parts, 0))]


@transition(lambda src, dst: _is_sum(src) and _is_token_shard(dst))
def _reduce_scatter(
    graph: Graph, value: Node, src, dst, sizes: TokenSizes, fill: int
) -> list[Node]:
    padded = _pad_tokens(graph, value, value.meta["val"].dim(), sizes)
    scattered = graph.call_function(
        c10d.reduce_scatter_tensor.default, (padded, "sum", sizes.tp, sizes.group_name)
    )
    return [padded, scattered, graph.call_function(c10d.wait_tensor.default, (scattered,))]


@transition(lambda src, dst: _is_sum(src) and isinstance(dst, Replicate))
def _all_reduce(graph: Graph, value: Node, src, dst, sizes: TokenSizes, fill: int) -> list[Node]:
    reduced = graph.call_function(c10d.all_reduce.default, (value, "sum", sizes.group_name))
    return [reduced, graph.call_function(c10d.wait_tensor.default, (reduced,))]


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
    val, d, tp = value.meta["val"], dst.dim, sizes.tp
    nodes = []
    if d == 0:  # the token dim: padded to tp*Tl rows, Tl per rank
        value = _pad_tokens(graph, value, val.dim(), sizes, fill)
        nodes.append(value)
        chunk: object = sizes.Tl
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
    for n in nodes:
        n.meta[REASON] = f"{format_placement(src)} -> {format_placement(dst)}: {why}"
        if choice is not None and getattr(n.target, "namespace", None) == "_c10d_functional":
            n.meta[REASON] += f"; {choice}"
        for key in ("stack_trace", "nn_module_stack", REGION):
            if key in site.meta:
                n.meta[key] = site.meta[key]
    return nodes[-1]


def _no_transition(value: Node, src: Placement, dst: Placement, why: str) -> str:
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return (
            f"{describe(value)} is {format_placement(src)} and a consumer needs it replicated; "
            f"only token shards (S(0)) are gathered in the sp layout ({why})"
        )
    if isinstance(src, Partial) and src.reduce_op != "sum":
        return f"{describe(value)}: only sum partials are reduced"
    return (
        f"{describe(value)}: no {format_placement(src)} -> {format_placement(dst)} transition "
        f"({why}); a tp all-to-all here means the plan or a rule put a value on the wrong "
        f"side of a layer boundary"
    )
