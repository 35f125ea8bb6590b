"""The rule registry: which placements an op's inputs must have and which its outputs get.

Order of lookup for a node:
1. the model adapter's rules (its routed-experts op: `spmd.rules.routed_experts`; its other custom ops), then
   ours (token-preserving views, the vocab-sharded lookup; the ops along the token dim:
   `spmd.token_ops`), registered with `@rule(op)`; a rule may return None to pass the node on;
2. every tensor input replicated -> every output replicated: a deterministic op of replicated
   values is replicated -- semantics, not a fallback;
3. DTensor's rules for ATen ops, through the one adapter module, where they hold for token
   shards (below);
otherwise the op has no rule: `NotImplementedError` naming node, op, placements and source line.

DTensor's rules are written for even shards of static sizes. The token dim is neither: a token
shard is `Tl = ceil(T/tp)` rows with padding at the tail, and the transitions move it between
`S(0)`, `R` and partial sums only. So an answer of DTensor's is taken for an op with a
token-sharded input only when it keeps the token dim on dim 0, and a partial sum over it is a
plain sum, max or min (not the mean's average over uneven shards, not a norm's or a product's)
in a dtype whose sum is exact enough (fp32, fp64, integers). Otherwise -- and where DTensor's
rule refuses the token shards -- the token-sharded inputs are gathered (`S(0) -> R`) and the
rules are asked again: any op is right on gathered rows, at the cost of the gather, which
`graph.py` lists with the op. The same for an ATen op DTensor has no rule for (`bincount`, a
keyed reduction that is a mean): its meaning is torch's, exact on all the rows. A custom op
of the model no rule knows is an error that says how to give it one: nothing here knows what
it does with the rows, and a rule is a few lines (docs/architecture.md, "Adding an op rule").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.fx import Node
from torch.fx.node import Argument

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.meta import GLOBAL_VAL, describe, is_tensor, tensor_inputs
from dsv41_compile.core.placements import format_placement
from dsv41_compile.core.registry import Registry
from dsv41_compile.core.strategy import RuleFn, Strategy
from dsv41_compile.core.symbols import PLANNING_TOKENS, hint, hint_shape, is_token_count
from dsv41_compile.core.torch_private import OpOverload, sym_hint
from dsv41_compile.spmd.rules.dtensor import PlacedTensor, propagate

__all__ = [
    "EXACT_SUMS",
    "RULES",
    "RuleAnswers",
    "RuleTable",
    "reads_an_unsplit_dim",
    "register_table",
    "is_token_shard",
    "rule",
    "rule_answers",
    "strategy_for",
    "tensor_outputs",
]

RULES: Registry[RuleFn] = Registry("sharding rule")
"""Our rules of ATen ops, by op."""


def rule(*ops: object) -> Callable[[RuleFn], RuleFn]:
    """Register the decorated function as the rule of `ops` (one rule per op): a rule of
    one's own, added at run time (docs/architecture.md, "Adding an op rule")."""

    def register(fn: RuleFn) -> RuleFn:
        for op in ops:
            RULES.add(op, fn)
        return fn

    return register


class RuleTable(dict[object, RuleFn]):
    """A module's rules by op, collected by `@table.rule(op)` and added to `RULES` where the
    package registers its rule modules (`spmd.rules`), not as a side effect of an import."""

    def rule(self, *ops: object) -> Callable[[RuleFn], RuleFn]:
        def collect(fn: RuleFn) -> RuleFn:
            for op in ops:
                if op in self:
                    raise ValueError(f"{op} has a rule in this table already")
                self[op] = fn
            return fn

        return collect


def register_table(table: RuleTable) -> None:
    """Add a module's rules to `RULES` (one rule per op across every table)."""
    for op, fn in table.items():
        RULES.add(op, fn)


EXACT_SUMS = (torch.float32, torch.float64, torch.int32, torch.int64)
"""Dtypes whose partial sums over the token shards add up to the single-device sum within
its own rounding: a lower-precision float is summed by one device in fp32 and rounded once."""


def _global(node: Node) -> torch.Tensor:
    return cast(torch.Tensor, node.meta.get(GLOBAL_VAL, node.meta.get("val")))


def is_token_shard(node: Node, placement: Placement | None) -> bool:
    """Whether `placement` of `node`'s value shards its token dim: `S(d)` with dim d of size T."""
    if not isinstance(placement, Shard):
        return False
    val = _global(node)
    return isinstance(val, torch.Tensor) and is_token_count(val.shape[placement.dim])


def _outputs(node: Node, placement: Placement) -> tuple[Placement | None, ...]:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return tuple(placement if isinstance(v, torch.Tensor) else None for v in val)
    return (placement if isinstance(val, torch.Tensor) else None,)


def reads_an_unsplit_dim(node: Node, placement: Placement) -> bool:
    """`node` is `sym_size.int` of a dim its tensor, placed `placement`, is not split along:
    the same size on every rank."""
    if node.target != torch.ops.aten.sym_size.int or type(placement) is not Shard:
        return False
    ndim = node.args[0].meta["val"].dim()
    return node.args[1] % ndim != placement.dim % ndim


@dataclass(frozen=True)
class RuleAnswers:
    """DTensor's answers asked in one compile, by question (`rules.dtensor.propagate`'s
    memo): the layers of a kind ask the same ones."""

    by_question: dict[object, Strategy | Exception] = field(default_factory=dict)


def rule_answers(ctx: CompileContext) -> dict[object, Strategy | Exception]:
    """This compile's memo of DTensor's answers (made on first use)."""
    answers = ctx.get(RuleAnswers, None)
    if answers is None:
        answers = RuleAnswers()
        ctx.put(answers)
    return answers.by_question


def tensor_outputs(
    node: Node, strategy: Strategy
) -> Iterator[tuple[Placement | None, torch.Tensor]]:
    """`(placement, value)` of each tensor output of `node` under `strategy`."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    for out, v in zip(strategy.outputs, vals):
        if isinstance(v, torch.Tensor):
            yield out, v


def strategy_for(
    node: Node,
    given: Sequence[Placement],
    mesh: DeviceMesh,
    model_rules: Mapping[Any, RuleFn] | None = None,
    answers: dict[object, Strategy | Exception] | None = None,
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
    pending = iter(given)

    def placed(arg: Argument) -> Any:  # a PlacedTensor for a tensor
        if is_tensor(arg):
            val = arg.meta["val"]
            return PlacedTensor(hint_shape(val), val.dtype, next(pending))
        if isinstance(arg, Node):
            return _hint(arg.meta.get("val"))
        return arg

    args = torch.fx.node.map_aggregate(node.args, placed)
    if node.kwargs and any(is_tensor(v) for v in node.kwargs.values()):
        raise NotImplementedError(f"{describe(node)}: tensor keyword arguments have no rule")
    placements = ", ".join(format_placement(p) for p in given)
    inputs = tensor_inputs(node)
    try:
        # a target DTensor has no rule for (an OpOverload or not) raises NotImplementedError
        op = cast(OpOverload, node.target)
        strategy = propagate(op, args, mesh, dict(node.kwargs), answers)
    except NotImplementedError:  # (before RuntimeError, its base class)
        if _is_aten(node.target):  # torch's op: exact on gathered rows
            why = f"DTensor has no rule for {node.target} on ({placements})"
            gathered = _tokens_gathered(node, inputs, given, mesh, model_rules, answers, why)
            if gathered is not None:
                return gathered
        raise NotImplementedError(
            f"no sharding rule for {describe(node)} with input placements ({placements}); add a "
            "rule for it (dsv41_compile/spmd/rules/, or the model adapter's `rules`: "
            'docs/architecture.md, "Adding an op rule") or change the model so this op sees '
            "replicated inputs"
        ) from None
    except (RuntimeError, AssertionError) as error:  # DTensor refuses this input sharding
        reason = str(error).strip().rstrip(".")
        why = f"DTensor's rule for {node.target} refuses ({placements})"
        gathered = _tokens_gathered(node, inputs, given, mesh, model_rules, answers, why)
        if gathered is not None:
            return gathered
        raise NotImplementedError(
            f"DTensor's rule for {describe(node)} rejects input placements ({placements}): "
            f"{reason}. A size this op splits is not a multiple of the mesh: check that tp "
            'divides it, or give the op a rule (docs/architecture.md, "Adding an op rule")'
        ) from None
    off = _off_token_layout(node, inputs, given, strategy)
    if off is None:
        return strategy, "dtensor"
    why = f"DTensor's rule for {node.target} {off}"
    gathered = _tokens_gathered(node, inputs, given, mesh, model_rules, answers, why)
    if gathered is None:
        raise NotImplementedError(
            f"{why}, at {describe(node)} with input placements ({placements}); give the op a "
            "rule (dsv41_compile/spmd/rules/ or the model adapter's `rules`: "
            'docs/architecture.md, "Adding an op rule")'
        )
    return gathered


def _off_token_layout(
    node: Node, inputs: list[Node], given: Sequence[Placement], strategy: Strategy
) -> str | None:
    """Why DTensor's `strategy` cannot run on token shards (the module docstring), or None."""
    sharded = False
    for producer, have, need in zip(inputs, given, strategy.inputs):
        if is_token_shard(producer, have):
            sharded = True
            if need != have and not isinstance(need, Replicate):
                return f"moves the token shards of {producer.name} to {format_placement(need)}"
        elif (
            need != have
            and is_token_shard(producer, need)
            and isinstance(need, Shard)
            and need.dim != 0
        ):
            return f"shards the token dim {need.dim} of {producer.name}"
        elif need != have and isinstance(need, Shard) and not _splittable(producer, need.dim):
            size = _global(producer).shape[need.dim]
            return f"splits dim {need.dim} of {producer.name}, of size {size}"
    if not sharded:
        return None
    for out, v in tensor_outputs(node, strategy):
        if isinstance(out, Shard):
            size = v.shape[out.dim]
            if is_token_count(size) and out.dim != 0:
                return f"leaves the token dim sharded on dim {out.dim}"
            if not _token_like(size, out.dim) and not isinstance(size, int):
                return f"shards a dim of size {size} (not the token count T)"
        elif isinstance(out, Replicate) and not _reads_no_rows(node):
            if any(is_token_shard(p, n) for p, n in zip(inputs, strategy.inputs)):
                return "replicates its output without gathering its token shards"
        elif isinstance(out, Partial):
            if type(out) is not Partial or out.reduce_op not in ("sum", "max", "min"):
                return f"makes a partial {format_placement(out)} of the token shards"
            if out.reduce_op == "sum" and v.dtype not in EXACT_SUMS:
                return f"sums the token shards in {v.dtype}"
    return None


def _is_aten(target: object) -> bool:
    """An op of torch's own (`aten`), whose meaning on replicated rows is torch's; not a
    model's custom op, whose meaning no rule here knows."""
    return isinstance(target, OpOverload) and target.namespace == "aten"


def _token_like(size: object, dim: int) -> bool:
    """A dim 0 the rules saw as T rows: T, or a size equal to it for T >= 1 (`x[:-1]` and one
    row, as a broadcast meets it), which a token shard's local slice pads or crops to tp*Tl."""
    return dim == 0 and isinstance(size, torch.SymInt) and hint(size) == PLANNING_TOKENS


def _splittable(node: Node, dim: int) -> bool:
    """Whether a replicated value's dim `dim` can be split into tp shards by a local slice: a
    static size (an even split), or a token-like dim 0."""
    size = _global(node).shape[dim]
    return isinstance(size, int) or _token_like(size, dim)


_NO_ROWS = {
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_ones.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_full.default,
    torch.ops.aten.new_empty_strided.default,
}


def _reads_no_rows(node: Node) -> bool:
    """Ops whose output is made from their input's dtype and device only (`new_zeros`)."""
    return node.target in _NO_ROWS


def _tokens_gathered(
    node: Node,
    inputs: list[Node],
    given: Sequence[Placement],
    mesh: DeviceMesh,
    model_rules: Mapping[Any, RuleFn] | None,
    answers: dict[object, Strategy | Exception] | None,
    why: str,
) -> tuple[Strategy, str] | None:
    """The strategy of `node` with its token-sharded inputs gathered, and why; None when it
    has none (the rules had nothing to gather)."""
    gathered = [Replicate() if is_token_shard(p, have) else have for p, have in zip(inputs, given)]
    if gathered == list(given):
        return None
    strategy, source = strategy_for(node, gathered, mesh, model_rules, answers)
    # the strategy asks for the gathered inputs: the token shards are gathered (S(0) -> R)
    return strategy, f"tokens gathered ({why}): {source}"


def _hint(val: object) -> object:
    if isinstance(val, torch.SymInt):
        return hint(val)
    if isinstance(val, (torch.SymFloat, torch.SymBool)):
        return sym_hint(val)
    return val
