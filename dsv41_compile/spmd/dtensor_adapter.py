"""The one module that touches DTensor's private sharding-propagation API.

`torch.distributed.tensor` keeps its op rules behind private names (`OpSchema`, `DTensorSpec`,
`TensorMeta`, the dispatcher's `sharding_propagator`). Every use of them in dsv41_compile goes
through `propagate` below, so a torch upgrade that moves them breaks one file and one test
(`tests/spmd/test_dtensor_adapter.py`), not the passes.

Rules run on concrete shapes, with the token count at `core.symbols.PLANNING_TOKENS`:
placements do not depend on the token count, and DTensor's propagator hashes its specs, which a
symbolic size cannot be.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.utils._pytree import tree_leaves, tree_map

from dsv41_compile.spmd.placements import format_placement

__all__ = ["PlacedTensor", "Strategy", "propagate"]


@dataclass(frozen=True)
class PlacedTensor:
    """A tensor argument of an op, as the rule sees it: global (hint) shape, dtype, placement."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    placement: Placement


@dataclass(frozen=True)
class Strategy:
    """DTensor's answer for one op: the placement each tensor input must have (equal to the
    given one unless the rule asks for a redistribution), one per tensor leaf of the arguments in
    pytree order, and the placement of each output (None for a non-tensor output)."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement | None, ...]

    def __str__(self) -> str:
        ins = ", ".join(format_placement(p) for p in self.inputs)
        outs = ", ".join(format_placement(p) for p in self.outputs)
        return f"({ins}) -> {outs}"


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


def propagate(
    op: torch._ops.OpOverload,
    args: Sequence[PlacedTensor | object],
    mesh: DeviceMesh,
    kwargs: dict[str, object] | None = None,
) -> Strategy:
    """Run DTensor's sharding rule of `op` on a one-axis `mesh`.

    `args` are the op's positional arguments: `PlacedTensor` for tensors (also inside lists, as
    for `cat` or `index`), plain values otherwise. Raises `NotImplementedError` when DTensor has
    no rule for `op`.
    """
    if mesh.ndim != 1:
        raise AssertionError(
            f"propagate works on one mesh axis at a time, got a {mesh.ndim}-D mesh"
        )
    is_placed = lambda x: isinstance(x, PlacedTensor)  # noqa: E731
    schema_args = tree_map(lambda a: _spec(mesh, a) if is_placed(a) else a, tuple(args))
    propagator = DTensor._op_dispatcher.sharding_propagator
    known = (
        propagator.op_strategy_funcs,
        propagator.op_single_dim_strategy_funcs,
        propagator.op_to_rules,
    )
    if not any(op in table for table in known):
        raise NotImplementedError(f"DTensor has no sharding rule for {op}")
    result = propagator.propagate_op_sharding_non_cached(OpSchema(op, schema_args, kwargs or {}))

    inputs = tuple(a.placement for a in tree_leaves(tuple(args)) if is_placed(a))
    if result.redistribute_schema is not None:
        needed = result.redistribute_schema.args_schema[: len(args)]
        inputs = tuple(s.placements[0] for s in tree_leaves(tuple(needed)) if _is_spec(s))
    return Strategy(inputs=inputs, outputs=_placements(result.output_spec))
