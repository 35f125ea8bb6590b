"""The one module that asks DTensor's sharding propagation.

`torch.distributed.tensor` keeps its op rules behind private names (`OpSchema`, `DTensorSpec`,
`TensorMeta`, the dispatcher's sharding propagator; imported in `core.torch_private`). Every
question the passes ask of them goes through `propagate` below.

Rules run on concrete shapes, with the token count at `core.symbols.PLANNING_TOKENS`:
placements do not depend on the token count, and DTensor's propagator hashes its specs, which a
symbolic size cannot be.

A rule's answer depends only on the op, the arguments' shapes, dtypes and placements, the
other arguments and the mesh, and a model repeats its layers: given a memo (`answers`: one per
compile, `spmd.rules.rule_answers`), `propagate` keeps every answer (and every refusal) in it, so
the second layer of a kind costs a dict lookup instead of DTensor's propagation (about 3 ms per
op).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.strategy import Strategy
from dsv41_compile.core.torch_private import (
    DTensorSpec,
    OpOverload,
    OpSchema,
    TensorMeta,
    new_unbacked_symbols_dropped,
    sharding_propagator,
    tree_leaves,
    tree_map,
)

__all__ = ["PlacedTensor", "propagate"]


@dataclass(frozen=True)
class PlacedTensor:
    """A tensor argument of an op, as the rule sees it: global (hint) shape, dtype, placement."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    placement: Placement


def _spec(mesh: DeviceMesh, arg: PlacedTensor) -> DTensorSpec:
    stride = torch.empty(arg.shape, device="meta").stride()
    return DTensorSpec(mesh, (arg.placement,), TensorMeta(torch.Size(arg.shape), stride, arg.dtype))


def _placements(spec: object) -> tuple[Placement | None, ...]:
    if isinstance(spec, DTensorSpec):
        return (spec.placements[0],)
    if isinstance(spec, Sequence):
        return tuple(s.placements[0] if isinstance(s, DTensorSpec) else None for s in spec)
    return (None,)


def _is_spec(x: object) -> bool:
    return isinstance(x, DTensorSpec)


def _hashable(x: object) -> object:
    """`x` as a key: lists and tuples as tagged tuples, dicts as sorted items."""
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *(_hashable(v) for v in x))
    if isinstance(x, dict):
        return ("dict", *sorted((k, _hashable(v)) for k, v in x.items()))
    return x


def propagate(
    op: OpOverload,
    args: Sequence[PlacedTensor | object],
    mesh: DeviceMesh,
    kwargs: dict[str, object] | None = None,
    answers: dict[object, Strategy | Exception] | None = None,
) -> Strategy:
    """Run DTensor's sharding rule of `op` on a one-axis `mesh` (once per distinct question
    in `answers`, when given: the module docstring).

    `args` are the op's positional arguments: `PlacedTensor` for tensors (also inside lists, as
    for `cat` or `index`), plain values otherwise. Raises `NotImplementedError` when DTensor has
    no rule for `op`.
    """
    if answers is None:
        return _propagate(op, args, mesh, kwargs)
    key = (op, _hashable(tuple(args)), mesh, _hashable(kwargs or {}))
    try:
        answer = answers.get(key)
    except TypeError:  # an argument that cannot be hashed: ask DTensor every time
        return _propagate(op, args, mesh, kwargs)
    if answer is None:
        try:
            answer = _propagate(op, args, mesh, kwargs)
        except (NotImplementedError, RuntimeError, ValueError, AssertionError) as error:
            answer = error
        answers[key] = answer
    if isinstance(answer, Exception):
        raise answer.with_traceback(None)
    return answer


def _propagate(
    op: OpOverload,
    args: Sequence[PlacedTensor | object],
    mesh: DeviceMesh,
    kwargs: dict[str, object] | None,
) -> Strategy:
    if mesh.ndim != 1:
        raise InternalError(f"propagate works on one mesh axis at a time, got a {mesh.ndim}-D mesh")
    is_placed = lambda x: isinstance(x, PlacedTensor)  # noqa: E731
    schema_args = tree_map(lambda a: _spec(mesh, a) if is_placed(a) else a, tuple(args))
    propagator = sharding_propagator()
    known = (
        propagator.op_strategy_funcs,
        propagator.op_single_dim_strategy_funcs,
        propagator.op_to_rules,
    )
    if not any(op in table for table in known):
        raise NotImplementedError(f"DTensor has no sharding rule for {op}")
    # DTensor runs the op on fake values of these sizes to learn its output's; an output sized
    # by values (an index by a boolean mask) makes an unbacked symbol that is no node's: left
    # pending, the fake propagation of `verify` would take it for one its first node lost
    with new_unbacked_symbols_dropped():
        result = propagator.propagate_op_sharding_non_cached(
            OpSchema(op, schema_args, kwargs or {})
        )

    inputs = tuple(a.placement for a in tree_leaves(tuple(args)) if is_placed(a))
    if result.redistribute_schema is not None:
        needed = result.redistribute_schema.args_schema[: len(args)]
        inputs = tuple(s.placements[0] for s in tree_leaves(tuple(needed)) if _is_spec(s))
    return Strategy(inputs=inputs, outputs=_placements(result.output_spec))
