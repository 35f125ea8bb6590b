"""The rule registry: which placements an op's inputs must have and which its outputs get.

Order of lookup for a node:
1. the model adapter's rules (its routed-experts op: `moe.rules`; its other custom ops), then
   ours (token-preserving views, the vocab-sharded lookup), registered with `@rule(op)`;
   a rule may return None to pass the node on;
2. every tensor input replicated -> every output replicated: a deterministic op of replicated
   values is replicated -- semantics, not a fallback;
3. DTensor's rules for ATen ops, through the one adapter module;
otherwise the op has no rule: `NotImplementedError` naming node, op, placements and source line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.meta import describe, is_tensor
from dsv41_compile.core.placements import format_placement
from dsv41_compile.core.registry import Registry
from dsv41_compile.core.strategy import RuleFn, Strategy
from dsv41_compile.core.symbols import hint, hint_shape
from dsv41_compile.spmd.dtensor_adapter import PlacedTensor, propagate

__all__ = ["RULES", "RuleAnswers", "rule", "rule_answers", "strategy_for"]

RULES: Registry[RuleFn] = Registry("sharding rule")
"""Our rules of ATen ops, by op."""


def rule(*ops: object) -> Callable[[RuleFn], RuleFn]:
    """Register the decorated function as the rule of `ops` (one rule per op)."""

    def register(fn: RuleFn) -> RuleFn:
        for op in ops:
            RULES.add(op, fn)
        return fn

    return register


def _outputs(node: Node, placement: Placement) -> tuple[Placement | None, ...]:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return tuple(placement if isinstance(v, torch.Tensor) else None for v in val)
    return (placement if isinstance(val, torch.Tensor) else None,)


@rule(
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


@rule(torch.ops.aten.embedding.default)
def _embedding(node: Node, given: Sequence[Placement]) -> Strategy | None:
    # Vocab-sharded rows: each rank looks up the ids in its own row range and leaves zeros for
    # the rest (localize writes the masking), so the output is a partial sum. DTensor's own rule
    # encodes the masking in a MaskPartial placement of the ids; ours keeps the ids replicated.
    weight, ids = given
    if weight == Shard(0) and ids == Replicate():
        return Strategy(inputs=(Shard(0), Replicate()), outputs=(Partial(),))
    return None


@dataclass(frozen=True)
class RuleAnswers:
    """DTensor's answers asked in one compile, by question (`dtensor_adapter.propagate`'s
    memo): the layers of a kind ask the same ones."""

    by_question: dict[object, object] = field(default_factory=dict)


def rule_answers(ctx: CompileContext) -> dict[object, object]:
    """This compile's memo of DTensor's answers (made on first use)."""
    answers = ctx.get(RuleAnswers, None)
    if answers is None:
        answers = RuleAnswers()
        ctx.put(answers)
    return answers.by_question


def strategy_for(
    node: Node,
    given: Sequence[Placement],
    mesh: DeviceMesh,
    model_rules: Mapping[object, RuleFn] | None = None,
    answers: dict[object, object] | None = None,
) -> tuple[Strategy, str]:
    """The strategy of `node` given its tensor inputs' placements, and which rule gave it;
    `model_rules` are the model adapter's (`spmd.annotate` passes them), `answers` the
    compile's memo of DTensor's answers (`rule_answers`)."""
    for table in (model_rules or {}, RULES):
        fn = table.get(node.target)
        if fn is not None:
            strategy = fn(node, given)
            if strategy is not None:
                return strategy, "dsv41"
    if all(p == Replicate() for p in given):
        return Strategy(inputs=tuple(given), outputs=_outputs(node, Replicate())), "replicated"
    placements = iter(given)

    def placed(arg: object) -> object:
        if is_tensor(arg):
            val = arg.meta["val"]
            return PlacedTensor(hint_shape(val), val.dtype, next(placements))
        if isinstance(arg, Node):
            return _hint(arg.meta.get("val"))
        return arg

    args = torch.fx.node.map_aggregate(node.args, placed)
    if node.kwargs and any(is_tensor(v) for v in node.kwargs.values()):
        raise NotImplementedError(f"{describe(node)}: tensor keyword arguments have no rule")
    placements = ", ".join(format_placement(p) for p in given)
    try:
        return propagate(node.target, args, mesh, dict(node.kwargs), answers), "dtensor"
    except NotImplementedError:  # (before RuntimeError, its base class)
        raise NotImplementedError(
            f"no sharding rule for {describe(node)} with input placements ({placements}); add a "
            "rule for it (dsv41_compile/spmd/rules.py, or the model adapter's `rules`: "
            "docs/architecture.md) or change the model so this op sees replicated inputs"
        ) from None
    except RuntimeError as error:  # DTensor refuses this input sharding outright
        reason = str(error).strip().rstrip(".")
        raise NotImplementedError(
            f"DTensor's rule for {describe(node)} rejects input placements ({placements}): "
            f"{reason}. A size this op splits is not a multiple of the mesh: check that tp "
            "divides it, or give the op a rule (docs/architecture.md)"
        ) from None


def _hint(val: object) -> object:
    if isinstance(val, torch.SymInt):
        return hint(val)
    if isinstance(val, (torch.SymFloat, torch.SymBool)):
        return val.node.hint
    return val
