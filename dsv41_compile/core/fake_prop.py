"""Fake propagation of a per-rank graph: every node's local value (`meta["val"]`), from the
program's local inputs (`verify`, and passes that read local shapes)."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node, map_arg
from torch.fx.experimental.proxy_tensor import snapshot_fake
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.meta import Unkeyed, metadata_key
from dsv41_compile.core.symbols import new_unbacked_symbols
from dsv41_compile.core.torch_private import (
    FakeTensorMode,
    OpOverload,
    enable_python_dispatcher,
    op_schema,
    tree_map_only,
)

__all__ = ["propagate_local_values", "propagate_nodes"]


def propagate_local_values(gm: GraphModule, ctx: CompileContext) -> None:
    """Set every node's `meta["val"]` to its local fake value."""
    with enable_python_dispatcher():  # the decompositions that take symbolic sizes
        _OnceProp(gm, mode=ctx.fake_mode).propagate_dont_convert_inputs(*ctx.local_inputs(gm))


def propagate_nodes(nodes: list[Node], ctx: CompileContext) -> None:
    """Set `meta["val"]` of `nodes` (in an order that puts inputs first) from their inputs'
    values: a pass's few new nodes, without propagating the whole graph again."""
    with ctx.fake_mode, enable_python_dispatcher():
        for node in nodes:
            args, kwargs = map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
            node.meta["val"] = node.target(*args, **kwargs)  # type: ignore[operator]


class _OnceProp(FakeTensorProp):
    """Fake propagation that runs each operator once per distinct input metadata.

    An operator's fake result is a function of its arguments' metadata (shapes, strides,
    dtypes, sizes as symbols), except where it reads data: a data-dependent operator (`.item()`,
    `nonzero`, ...), an argument holding a constant, or a result with a size its inputs do not
    hold (a new unbacked symbol) -- those are always run. The layers of one kind are the same
    operators on inputs of the same metadata, so the second and later layers of a kind get the
    first's results (the same fake tensors) instead of recomputing them: verify's cost is that
    of the distinct layer kinds, not of every layer. (FakeTensorMode's own cache still builds a
    new fake tensor per node, which is what the propagation of a long graph spends its time on.)
    """

    def __init__(self, gm: GraphModule, mode: FakeTensorMode) -> None:
        super().__init__(gm, mode)
        self._results: dict[tuple[object, ...], object] = {}

    def call_function(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not isinstance(target, OpOverload) or op_schema(target).is_mutable:
            return super().call_function(target, args, kwargs)
        if _READS_DATA.intersection(target.tags):
            # A result shared with an earlier layer carries that layer's memo of its data
            # (FakeTensor.item_memo, ...): read a fresh alias of it instead.
            args, kwargs = tree_map_only(torch.Tensor, snapshot_fake, (args, kwargs))
            return super().call_function(target, args, kwargs)
        try:
            key = (target, metadata_key(args), metadata_key(kwargs))
            hash(key)
        except (Unkeyed, TypeError):
            return super().call_function(target, args, kwargs)
        if key in self._results:
            return self._results[key]
        result = super().call_function(target, args, kwargs)
        if not new_unbacked_symbols(result, (args, kwargs)):
            self._results[key] = result
        return result


_READS_DATA = {
    torch.Tag.data_dependent_output,
    torch.Tag.dynamic_output_shape,
    torch.Tag.inplace_view,
}
