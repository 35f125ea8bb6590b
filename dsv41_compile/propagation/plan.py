"""The sharding plan: what the user-level layout pins, before propagation fills in the rest.

Two declarative tables keyed by module FQN pattern (`*` matches one path segment):

- `params`: the placement of each parameter on the tp axis (default: replicated).
- `anchors`: the placement every activation must have when it *enters* a module (torchtitan's
  `PrepareModuleInput`): the residual streams are token-sharded at every layer boundary, the
  attention input is replicated (one AllGather), the MoE half works on local tokens, the head
  on the gathered hidden. The innermost anchored module of a node decides.
- `exits`: the placement every activation must have when it *leaves* a module (torchtitan's
  `PrepareModuleOutput`); the replicated baseline shares each MoE's output back to the TP group.
- `partial_to`: where a partial sum goes before its first use -- token shards (ReduceScatter,
  `sp`) or replicated (all-reduce, the `replicated` baseline).

Everything else is propagated by the op rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch.distributed.tensor import Placement, Replicate, Shard

__all__ = ["ExpertShard", "ShardingPlan", "deepseek_v41_plan"]


@dataclass(frozen=True)
class ExpertShard(Placement):
    """Sharded on the expert dim over the ep axis (the whole world, not the tp axis): rank r
    holds experts `[r*E/ep, (r+1)*E/ep)`. Only the routed-experts op consumes such a value; the
    expert_parallel pass turns that op into dispatch -> local experts -> combine."""

    dim: int = 0

    def __repr__(self) -> str:
        return f"E({self.dim})"


def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")


@dataclass(frozen=True)
class ShardingPlan:
    params: tuple[tuple[str, Placement], ...]
    """(parameter FQN pattern, placement); first match wins; unmatched parameters replicate."""
    anchors: tuple[tuple[str, Placement], ...]
    """(module FQN pattern, placement of the activations entering it)."""
    exits: tuple[tuple[str, Placement], ...] = ()
    """(module FQN pattern, placement of the activations leaving it)."""
    partial_to: Placement = Shard(0)
    """The placement a partial sum is redistributed to before any use."""

    def param_placement(self, fqn: str) -> Placement:
        for pattern, placement in self.params:
            if _compile(pattern).match(fqn):
                return placement
        return Replicate()

    def anchor(self, module_paths: list[str]) -> tuple[str, Placement] | None:
        """The innermost anchored module among `module_paths` (outermost first) and its
        placement, or None."""
        return _innermost(self.anchors, module_paths)

    def exit(self, module_paths: list[str]) -> tuple[str, Placement] | None:
        """The innermost module among `module_paths` with an exit placement, or None."""
        return _innermost(self.exits, module_paths)


def _innermost(
    table: tuple[tuple[str, Placement], ...], module_paths: list[str]
) -> tuple[str, Placement] | None:
    for path in reversed(module_paths):
        for pattern, placement in table:
            if _compile(pattern).match(path):
                return path, placement
    return None


def deepseek_v41_plan(
    *, embedding: str = "replicated", ep: int = 1, layout: str = "sp"
) -> ShardingPlan:
    """DESIGN §2 (`layout="sp"`): heads and output groups sharded over tp, latents /
    compressor / indexer replicated, row-parallel `wo_b` (a partial sum, reduce-scattered),
    everything per-token sharded by token; with ep > 1 the routed experts' weights are sharded
    on the expert dim over the world.

    DESIGN §6 (`layout="replicated"`, the baseline): the same parameter placements, but every
    activation outside attention is replicated over the TP group: the `wo_b` partial is
    all-reduced, mHC / norms / gate / shared expert run on all T tokens. With ep > 1 each token
    is dispatched by exactly one TP rank (the routed-experts rule takes token shards) and the
    MoE's output leaves the MoE replicated (one AllGather)."""
    params: list[tuple[str, Placement]] = [
        ("layers.*.attn.wq_b.weight", Shard(0)),  # [H*d, q_lora]: heads
        ("layers.*.attn.attn_sink", Shard(0)),  # [H]
        ("layers.*.attn.wo_a.weight", Shard(0)),  # [G*o_lora, H/G*d]: output groups
        ("layers.*.attn.wo_b.weight", Shard(1)),  # [D, G*o_lora]: row-parallel
    ]
    if embedding == "vocab_sharded":
        params.append(("embed.weight", Shard(0)))
    if ep > 1:
        params += [(f"layers.*.ffn.experts.{w}", ExpertShard(0)) for w in ("w1", "w2", "w3")]
    if layout == "replicated":
        return ShardingPlan(
            params=tuple(params),
            # Every anchor replicated; they still name the regions (attention / MoE half).
            anchors=tuple(
                (path, Replicate())
                for path in ("layers.*", "layers.*.attn", "layers.*.ffn", "head")
            ),
            exits=(("layers.*.ffn", Replicate()),),
            partial_to=Replicate(),
        )
    if layout != "sp":
        raise ValueError(f"layout={layout!r}: the plans are 'sp' and 'replicated'")
    anchors: tuple[tuple[str, Placement], ...] = (
        ("layers.*", Shard(0)),
        ("layers.*.attn", Replicate()),
        ("layers.*.ffn", Shard(0)),
        ("head", Replicate()),
    )
    return ShardingPlan(params=tuple(params), anchors=anchors)
