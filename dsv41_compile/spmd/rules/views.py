"""Our rules of ATen ops that keep a token shard where DTensor's would refuse it, or that
DTensor writes another way: token-preserving views, size reads along an unsplit dim, the
vocab-sharded lookup (`spmd.vocab`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dsv41_compile.core.strategy import Strategy
from dsv41_compile.spmd.rules.registry import RuleTable, reads_an_unsplit_dim

__all__ = ["VIEW_RULES"]

VIEW_RULES = RuleTable()
"""The rules of this module, by op (registered by `spmd.rules`)."""


@VIEW_RULES.rule(
    torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default
)
def _view(node: Node, given: Sequence[Placement]) -> Strategy | None:
    # A view that keeps dim 0 and reshapes only the trailing dims keeps a token shard. DTensor's
    # view rule sees a token count of 1 (a specialised decode graph) as a singleton dim and
    # would refuse; everything else goes to DTensor.
    source, out = node.args[0].meta["val"], node.meta["val"]
    if (
        given[0] == Shard(0)
        and out.dim() >= 1
        and statically_known_true(source.shape[0] == out.shape[0])
    ):
        return Strategy(inputs=(Shard(0),), outputs=(Shard(0),))
    return None


@VIEW_RULES.rule(torch.ops.aten.sym_size.int)
def _size(node: Node, given: Sequence[Placement]) -> Strategy | None:
    # annotate refuses a read along the split dim
    (placement,) = given
    if reads_an_unsplit_dim(node, placement):
        return Strategy(inputs=(placement,), outputs=(None,))
    return None


@VIEW_RULES.rule(torch.ops.aten.embedding.default)
def _embedding(node: Node, given: Sequence[Placement]) -> Strategy | None:
    # Vocab-sharded rows: each rank looks up the ids in its own row range and leaves zeros for
    # the rest (localize writes the masking), so the output is a partial sum. DTensor's own rule
    # encodes the masking in a MaskPartial placement of the ids; ours keeps the ids replicated.
    weight, ids = given
    if weight == Shard(0) and ids == Replicate():
        return Strategy(inputs=(Shard(0), Replicate()), outputs=(Partial(),))
    return None
