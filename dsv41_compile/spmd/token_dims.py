"""What the rules of the ops along the token dim (`spmd.rules.token_ops`) and their per-rank
forms (`spmd.token_ops`) share: the compiler's shift op, the dims a reduction or a roll acts
on, the reductions keyed by an index."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor
from torch.distributed.tensor import Shard
from torch.fx import Node

from dsv41_compile.core.errors import as_node
from dsv41_compile.core.meta import GLOBAL_VAL

__all__ = ["KEYED", "TOKENS", "global_value", "reduced_dims", "roll_dims", "shift_tokens"]

aten = torch.ops.aten
TOKENS = Shard(0)
"""A token shard."""


@torch.library.custom_op("dsv41_sp::shift_tokens", mutates_args=())
def shift_tokens(x: Tensor, shift: int, outside: Tensor) -> Tensor:
    """`x` moved by `shift` rows along dim 0, row t getting row t - shift; the |shift| rows
    with no source get `outside`'s, in order (`shift` > 0: the first rows; < 0: the last).
    The compiler's form of a shift written as a slice and a cat or a pad (`token_shifts`);
    `localize` replaces it."""
    T, k = x.shape[0], abs(shift)
    if shift > 0:
        return torch.cat([outside, x])[:T]
    return torch.cat([x, outside])[k : k + T]


@shift_tokens.register_fake
def _(x: Tensor, shift: int, outside: Tensor) -> Tensor:
    return torch.empty_like(x)


def global_value(node: Node) -> Tensor:
    return cast(Tensor, node.meta.get(GLOBAL_VAL, node.meta.get("val")))


def reduced_dims(node: Node) -> list[int]:
    """The dims a reduction reduces (all for the `.default` overloads)."""
    ndim = global_value(as_node(node.args[0], "a token op's argument")).dim()
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if node.target is aten.mean.default or dims in (None, []):
        return list(range(ndim))
    listed = [dims] if isinstance(dims, int) else cast(Sequence[int], dims)
    return sorted(d % ndim for d in listed)


KEYED = (
    aten.index_add.default,
    aten.scatter_add.default,
    aten.scatter_reduce.two,
    aten.index_reduce.default,
)
"""Reductions keyed by an index (`out[index[t]] (+)= source[t]`): along the tokens, a
reduction of each rank's rows into the whole output."""


def roll_dims(node: Node) -> list[int]:
    ndim = global_value(as_node(node.args[0], "a token op's argument")).dim()
    dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims", [])
    return [d % ndim for d in cast(Sequence[int], dims)]
