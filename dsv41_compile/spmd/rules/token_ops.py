"""The rules of the ops along the token dim of token shards (the table in `spmd.token_ops`,
whose per-rank forms `localize` writes): a mean or a keyed reduction as a partial, a scan,
a shift or a roll kept on the shard, a replicated value's rows at the tokens' keys, one row
at a computed index, rows written at computed indices, and `cat` / `stack` of token shards."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dsv41_compile.core.errors import as_node
from dsv41_compile.core.strategy import Strategy
from dsv41_compile.core.torch_private import custom_op_overload
from dsv41_compile.spmd.rules.registry import EXACT_SUMS, RuleTable, is_token_shard
from dsv41_compile.spmd.token_dims import (
    KEYED,
    TOKENS,
    global_value,
    reduced_dims,
    roll_dims,
    shift_tokens,
)

__all__ = ["TOKEN_RULES"]

aten = torch.ops.aten

TOKEN_RULES = RuleTable()
"""The rules of this module, by op (registered by `spmd.rules`)."""


@TOKEN_RULES.rule(aten.mean.dim, aten.mean.default)
def _mean(node: Node, given: Sequence[Placement]) -> Strategy | None:
    # The mean over the token dim is the sum of the real rows divided by T: a partial sum
    # (DTensor's average of the shards' means is wrong for uneven shards).
    (x,) = given
    if not is_token_shard(
        as_node(node.args[0], "a token op's argument"), x
    ) or 0 not in reduced_dims(node):
        return None
    if node.meta["val"].dtype not in EXACT_SUMS:
        return None
    return Strategy(inputs=(x,), outputs=(Partial(),))


@TOKEN_RULES.rule(aten.cumsum.default)
def _cumsum(node: Node, given: Sequence[Placement]) -> Strategy | None:
    # A scan of the shard plus the totals of the shards before it.
    (x,) = given
    dim = (
        cast(int, node.args[1]) % global_value(as_node(node.args[0], "a token op's argument")).dim()
    )
    if not is_token_shard(as_node(node.args[0], "a token op's argument"), x) or dim != 0:
        return None
    if node.meta["val"].dtype not in EXACT_SUMS:
        return None
    return Strategy(inputs=(x,), outputs=(x,))


@TOKEN_RULES.rule(aten.roll.default)
def _roll(node: Node, given: Sequence[Placement]) -> Strategy | None:
    (x,) = given
    if is_token_shard(as_node(node.args[0], "a token op's argument"), x) and 0 in roll_dims(node):
        return Strategy(inputs=(x,), outputs=(x,))
    return None


@TOKEN_RULES.rule(custom_op_overload(shift_tokens))
def _shift(node: Node, given: Sequence[Placement]) -> Strategy | None:
    x, _ = given
    if is_token_shard(as_node(node.args[0], "a token op's argument"), x):
        return Strategy(inputs=(x, Replicate()), outputs=(x,))
    return None


@TOKEN_RULES.rule(aten.cat.default)
def _cat(node: Node, given: Sequence[Placement]) -> Strategy | None:
    # Token shards concatenated along the token dim are not a token shard of the result:
    # gather them. (DTensor's rule keeps them sharded and calls the result replicated.)
    tensors = cast(Sequence[Node], node.args[0])
    dim = cast(int, node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0))
    dim %= max(global_value(tensors[0]).dim(), 1)
    if any(
        is_token_shard(t, p) and isinstance(p, Shard) and p.dim == dim
        for t, p in zip(tensors, given)
    ):
        return Strategy(inputs=tuple(Replicate() for _ in given), outputs=(Replicate(),))
    return _replicated_pieces_split(tensors, given)


@TOKEN_RULES.rule(aten.stack.default)
def _stack(node: Node, given: Sequence[Placement]) -> Strategy | None:
    dim = cast(int, node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0))
    if dim % node.meta["val"].dim() == 0:  # a new dim before the tokens: DTensor's rule
        return None
    return _replicated_pieces_split(cast(Sequence[Node], node.args[0]), given)


def _replicated_pieces_split(
    tensors: Sequence[Node], given: Sequence[Placement]
) -> Strategy | None:
    """Replicated pieces next to token shards, joined along another dim than the tokens (cat,
    stack): every piece a token shard, a replicated one by a local slice. DTensor's rules answer
    (R, S(0)) -> S(0) with no redistribution, which would join a whole piece to a shard."""
    shards = {p for t, p in zip(tensors, given) if is_token_shard(t, p)}
    if len(shards) == 1 and set(given) == {*shards, Replicate()}:
        (shard,) = shards
        return Strategy(inputs=(shard,) * len(given), outputs=(shard,))
    return None


_KEYED_PARTIALS = {"sum": "sum", "amax": "max", "amin": "min"}
"""A keyed reduction whose per-rank results combine by an all-reduce: their partial."""


def _keyed_reduction(node: Node) -> str | None:
    """The partial a keyed reduction's per-rank results make ("sum", "max", "min"), or None:
    a mean or a product (the ranks' results do not combine), or `include_self=False` (a rank
    whose rows miss an output row leaves `self`'s value there, where the op would not)."""
    if node.target in (aten.index_add.default, aten.scatter_add.default):
        return "sum"
    if node.target not in KEYED:
        return None
    reduce = cast(str, node.args[4] if len(node.args) > 4 else node.kwargs["reduce"])
    include_self = node.args[5] if len(node.args) > 5 else node.kwargs.get("include_self", True)
    return _KEYED_PARTIALS.get(reduce) if include_self else None


@TOKEN_RULES.rule(*KEYED)
def _keyed(node: Node, given: Sequence[Placement]) -> Strategy | None:
    # Each rank reduces its own tokens' rows into the whole output: a partial of the output,
    # all-reduced (the rows of the batch never move). A sum starts from `self` on one rank
    # (R -> P: zeros elsewhere); a max or a min from `self` on every rank.
    self_, index, source = given
    dim = cast(int, node.args[1])
    x, idx, src = (as_node(node.args[i], "a keyed reduction's argument") for i in (0, 2, 3))
    if dim % max(global_value(x).dim(), 1) != 0 or is_token_shard(x, self_):
        return None
    if not (is_token_shard(idx, index) and is_token_shard(src, source)):
        return None
    reduce = _keyed_reduction(node)
    if reduce is None or (reduce == "sum" and node.meta["val"].dtype not in EXACT_SUMS):
        return None
    start = Partial() if reduce == "sum" else Replicate()
    return Strategy(inputs=(start, TOKENS, TOKENS), outputs=(Partial(reduce),))


def _one_index(node: Node) -> Node | None:
    """The index tensor of an `index` / `index_put` along dim 0 alone, of an integer dtype (a
    bool mask selects rows the data decides), or None."""
    indices = cast(Sequence[Node | None], node.args[1])
    if len(indices) != 1 or indices[0] is None:
        return None
    dtype = global_value(indices[0]).dtype
    return None if dtype is torch.bool or dtype.is_floating_point else indices[0]


@TOKEN_RULES.rule(aten.index.Tensor)
def _rows_at(node: Node, given: Sequence[Placement]) -> Strategy | None:
    index = _one_index(node)
    if index is None or len(given) != 2:
        return None
    x = as_node(node.args[0], "an index's value")
    self_, at = given
    # A replicated value's rows at the tokens' indices (`per_request_DT[slot_T]`): each rank
    # reads the rows of its own tokens, as an embedding does; the result is a token shard.
    if self_ == Replicate() and is_token_shard(index, at):
        return Strategy(inputs=(Replicate(), TOKENS), outputs=(TOKENS,))
    # One token's row at a replicated index (`x_TD[top_1]`, `x_TD[-1]`): each rank gives the
    # row if it holds it and zeros if not, a partial sum of one row (not a gather of T rows).
    # More rows are gathered: in a graph Dynamo traced at a static T, an index of T0 rows
    # made from T (`torch.arange(T)`) is a number that cannot be told from K.
    if not is_token_shard(x, self_) or at != Replicate():
        return None
    one = statically_known_true(math.prod(global_value(index).shape) == 1)
    if not one or node.meta["val"].dtype not in EXACT_SUMS:
        return None
    return Strategy(inputs=(TOKENS, Replicate()), outputs=(Partial(),))


@TOKEN_RULES.rule(aten.index_put.default, aten.index_copy.default)
def _write_rows_at(node: Node, given: Sequence[Placement]) -> Strategy | None:
    # Rows written at replicated token indices (`x_TD[top] = v`, `x.index_copy(0, top, v)`):
    # each rank writes the rows it holds; the others' writes land in a scratch row. The token
    # shard stays a token shard.
    x = as_node(node.args[0], "a write's value")
    if node.target is aten.index_copy.default:
        dim = cast(int, node.args[1]) % max(global_value(x).dim(), 1)
        index = as_node(node.args[2], "an index_copy's index") if dim == 0 else None
    else:
        index = _one_index(node)
    if index is None or len(given) != 3 or not is_token_shard(x, given[0]):
        return None
    if tuple(given[1:]) != (Replicate(), Replicate()):
        return None
    return Strategy(inputs=(TOKENS, Replicate(), Replicate()), outputs=(TOKENS,))
