"""The sharding plan: what the user-level layout pins, before propagation fills in the rest.

Tables keyed by FQN pattern (`*` matches one path segment):

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

A pattern that matches nothing is a mistake -- a typo would leave its parameters replicated:
a correct program, silently slower -- so `check_matches` refuses it, naming the pattern and the
closest names the model has. An entry that may match nothing says why (`Entry.optional`): the
scales of a quantised weight exist only where the model holds its weights as released. The
vocabulary below writes a linear's entries, its scales' included: `colwise` (its output
features split), `rowwise` (its input features split, its output a partial sum),
`with_scales` (any placement, and the scales' placed alike).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache

from torch.distributed.tensor import Placement, Replicate, Shard

__all__ = [
    "SCALES",
    "Entry",
    "ShardingPlan",
    "colwise",
    "pattern_matches",
    "rowwise",
    "with_scales",
]

SCALES = "the scales of a quantised weight: only a model holding its weights as released has them"
"""Why a scales entry may match nothing (`with_scales`)."""


@cache
def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")


def pattern_matches(pattern: str, fqn: str) -> bool:
    """Whether the module / parameter FQN `fqn` matches `pattern` (`*`: one path segment)."""
    return _compile(pattern).match(fqn) is not None


@dataclass(frozen=True)
class Entry:
    """One row of a plan's table: an FQN pattern and its placement. `optional` says why the
    pattern may match nothing in a model (None: it must match something)."""

    pattern: str
    placement: Placement
    optional: str | None = None


def with_scales(weight: str, placement: Placement, scales: str) -> tuple[Entry, Entry]:
    """`weight` placed `placement`, and the pattern of its scales (`scales`), which a model has
    only when it holds the weight as released, placed alike."""
    return Entry(weight, placement), Entry(scales, placement, optional=SCALES)


def colwise(module: str, *, scales: bool = False) -> tuple[Entry, ...]:
    """A column-parallel linear `module`: its weight `[out, in]` split on its output features
    (each rank computes its slice of the output); `scales`: with its block scales
    (`{module}.scale`) where the model holds them."""
    return _linear(module, Shard(0), scales)


def rowwise(module: str, *, scales: bool = False) -> tuple[Entry, ...]:
    """A row-parallel linear `module`: its weight `[out, in]` split on its input features
    (each rank's product is a partial sum of the output); `scales` as `colwise`."""
    return _linear(module, Shard(1), scales)


def _linear(module: str, placement: Placement, scales: bool) -> tuple[Entry, ...]:
    weight = f"{module}.weight"
    if scales:
        return with_scales(weight, placement, f"{module}.scale")
    return (Entry(weight, placement),)


def _entries(rows: Iterable[Entry | tuple[str, Placement]]) -> tuple[Entry, ...]:
    return tuple(r if isinstance(r, Entry) else Entry(*r) for r in rows)


@dataclass(frozen=True)
class ShardingPlan:
    params: tuple[Entry, ...]
    """(parameter FQN pattern, placement); first match wins; unmatched parameters replicate.
    Rows may be given as `(pattern, placement)` pairs."""
    anchors: tuple[Entry, ...]
    """(module FQN pattern, placement of the activations entering it)."""
    exits: tuple[Entry, ...] = ()
    """(module FQN pattern, placement of the activations leaving it)."""
    partial_to: Placement = Shard(0)
    """The placement a partial sum is redistributed to before any use."""
    entry_cuts: tuple[str, ...] = ()
    """Module FQN patterns of Replicate-anchored regions where the entry AllGather moves to the
    cheapest cut of the per-token ops reading the token-sharded input (`spmd.entry_cut`)."""
    entry_cut_reason: str = "entry cut"
    """How `graph.py` names what asked for the entry cuts (a family's option, for example)."""

    def __post_init__(self) -> None:
        for name in ("params", "anchors", "exits"):
            object.__setattr__(self, name, _entries(getattr(self, name)))

    def param_placement(self, fqn: str) -> Placement:
        for entry in self.params:
            if pattern_matches(entry.pattern, fqn):
                return entry.placement
        return Replicate()

    def anchor(self, module_paths: list[str]) -> tuple[str, Placement] | None:
        """The innermost anchored module among `module_paths` (outermost first) and its
        placement, or None."""
        return _innermost(self.anchors, module_paths)

    def exit(self, module_paths: list[str]) -> tuple[str, Placement] | None:
        """The innermost module among `module_paths` with an exit placement, or None."""
        return _innermost(self.exits, module_paths)

    def check_matches(self, param_fqns: Iterable[str], module_paths: Iterable[str]) -> None:
        """A ValueError naming each pattern that matches none of a model's parameters
        (`params`) or modules (the rest), unless it says it may, with the closest names."""
        params, modules = sorted(set(param_fqns)), sorted(set(module_paths))
        tables: list[tuple[str, list[tuple[str, str | None]], list[str], str]] = [
            ("params", [(e.pattern, e.optional) for e in self.params], params, "parameter"),
            ("anchors", [(e.pattern, e.optional) for e in self.anchors], modules, "module"),
            ("exits", [(e.pattern, e.optional) for e in self.exits], modules, "module"),
            ("entry_cuts", [(p, None) for p in self.entry_cuts], modules, "module"),
        ]
        problems = []
        for table, patterns, names, kind in tables:
            for pattern, optional in patterns:
                if optional is not None:
                    continue
                if not any(pattern_matches(pattern, name) for name in names):
                    problems.append(_unmatched(table, pattern, names, kind))
        if problems:
            raise ValueError(
                "the sharding plan names what this model does not have -- its parameters would "
                "silently stay replicated, or its activations unplaced: "
                + "; ".join(problems)
                + ". Correct the pattern (`*` stands for one path segment), or mark an entry "
                "that may match nothing as optional (core.plan.Entry)"
            )


def _unmatched(table: str, pattern: str, names: list[str], kind: str) -> str:
    """One unmatched pattern and the closest of `names`, written as patterns (`layers.*.x`)."""
    shapes = sorted({re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", n) for n in names})
    closest = difflib.get_close_matches(pattern, shapes, n=3, cutoff=0.75)
    near = f" (closest: {', '.join(closest)})" if closest else f" (no {kind} name is close)"
    return f"{table} pattern {pattern!r} matches no {kind}{near}"


def _innermost(table: tuple[Entry, ...], module_paths: list[str]) -> tuple[str, Placement] | None:
    for path in reversed(module_paths):
        for entry in table:
            if pattern_matches(entry.pattern, path):
                return path, entry.placement
    return None
