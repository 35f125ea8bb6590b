"""The sharding rule of a routed-experts op (`core.adapter.RoutedExperts`).

Token-wise in its token inputs (x, topk_idx, topk_weight). With expert-sharded weights
(ep > 1) every rank routes its own token shard: the token inputs are token-sharded in and out
whatever the attention layout, and `moe.expert_parallel` lowers the op to dispatch / local
experts / combine. With whole weights (ep = 1) the token inputs share one placement and every
rank runs every expert on the rows it holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor import Placement, Replicate, Shard
from torch.fx import Node

from dsv41_compile.core.adapter import RoutedExperts
from dsv41_compile.core.placements import ExpertShard
from dsv41_compile.core.strategy import RuleFn, Strategy

__all__ = ["routed_experts_rule"]


def routed_experts_rule(spec: RoutedExperts) -> RuleFn:
    tokens, n = len(spec.TOKEN_ARGS), spec.n_weights

    def rule(node: Node, given: Sequence[Placement]) -> Strategy:
        if any(isinstance(p, ExpertShard) for p in given[tokens:]):
            return Strategy(
                inputs=(Shard(0),) * tokens + (ExpertShard(0),) * n, outputs=(Shard(0),)
            )
        token = Shard(0) if any(p == Shard(0) for p in given[:tokens]) else Replicate()
        return Strategy(inputs=(token,) * tokens + (Replicate(),) * n, outputs=(token,))

    return rule
