"""What a sharding rule answers: the placement each tensor input of an op must have and the
placement of each output (`Strategy`), and the signature of a rule (`RuleFn`). The rules
themselves live with the passes (`spmd.rules`, DTensor's through `spmd.rules.dtensor`) and
with the model families (`ModelAdapter.rules`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Placement
from torch.fx import Node

from dsv41_compile.core.placements import format_placement

__all__ = ["RuleFn", "Strategy"]


@dataclass(frozen=True)
class Strategy:
    """A rule's answer for one op: the placement each tensor input must have (equal to the
    given one unless the rule asks for a redistribution), one per tensor leaf of the arguments in
    pytree order, and the placement of each output (None for a non-tensor output)."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement | None, ...]

    def __str__(self) -> str:
        ins = ", ".join(format_placement(p) for p in self.inputs)
        outs = ", ".join(format_placement(p) for p in self.outputs)
        return f"({ins}) -> {outs}"


RuleFn = Callable[[Node, Sequence[Placement]], Strategy | None]
"""`rule(node, given)`: the strategy of `node` given its tensor inputs' placements, or None to
pass the node on to the next rule."""
