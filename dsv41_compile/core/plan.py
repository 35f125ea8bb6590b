"""The sharding plan: what the user-level layout pins, before propagation fills in the rest.

Two declarative tables keyed by module FQN pattern (`*` matches one path segment):

- `params`: the placement of each parameter on the tp axis (default: replicated).
- `anchors`: the placement every activation must have when it *enters* a module (torchtitan's
  `PrepareModuleInput`), e.g. token shards at every decoder-layer boundary, a replicated
  attention input. The innermost anchored module of a node decides, and names its region.
- `exits`: the placement every activation must have when it *leaves* a module (torchtitan's
  `PrepareModuleOutput`), e.g. a MoE output shared back to the TP group.
- `partial_to`: where a partial sum goes before its first use -- token shards (ReduceScatter,
  `sp`) or replicated (all-reduce, the `replicated` baseline).
- `entry_cuts`: replicated-anchor regions whose gather may move past the per-token ops that
  read their input (`spmd.entry_cut`), e.g. sp's attention gathering its q / kv latents.

Everything else is propagated by the op rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch.distributed.tensor import Placement, Replicate, Shard

__all__ = ["ShardingPlan", "pattern_matches"]


def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")


def pattern_matches(pattern: str, fqn: str) -> bool:
    """Whether the module / parameter FQN `fqn` matches `pattern` (`*`: one path segment)."""
    return _compile(pattern).match(fqn) is not None


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
    entry_cuts: tuple[str, ...] = ()
    """Module FQN patterns of Replicate-anchored regions where the entry AllGather moves to the
    cheapest cut of the per-token ops reading the token-sharded input (`spmd.entry_cut`)."""

    def param_placement(self, fqn: str) -> Placement:
        for pattern, placement in self.params:
            if pattern_matches(pattern, fqn):
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
            if pattern_matches(pattern, path):
                return path, placement
    return None
