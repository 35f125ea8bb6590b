"""Small graphs for pass tests: one op as a graph, with fake values on its nodes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.fx import Graph, GraphModule
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dsv41_compile.core.torch_private import FakeTensorMode

__all__ = ["one_op_graph", "rewritten_for_graph_mode"]


def one_op_graph(op: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[GraphModule, list]:
    """`op(*args, **kwargs)` as a one-node graph whose inputs are the tensors among the
    arguments (also inside lists), with fake values propagated; returns it and those tensors."""
    graph, tensors = Graph(), []

    def lift(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return graph.placeholder(f"t{len(tensors)}")
        if isinstance(value, (list, tuple)):
            return type(value)(lift(v) for v in value)
        return value

    graph.output(graph.call_function(op, lift(args), lift(kwargs)))
    gm = GraphModule(torch.nn.Module(), graph)
    FakeTensorProp(gm, FakeTensorMode()).propagate(*tensors)
    return gm, tensors


def rewritten_for_graph_mode(
    op: Callable[..., Any], *args: Any, rewrites: Mapping[Any, Any] | None = None, **kwargs: Any
) -> tuple[GraphModule, list]:
    """`one_op_graph` after `targets.npu_passes.rewrite_for_graph_mode` (with the model's
    `rewrites`); fails if `op` is still in it."""
    from dsv41_compile.targets.npu_passes import rewrite_for_graph_mode

    gm, tensors = one_op_graph(op, *args, **kwargs)
    rewrite_for_graph_mode(gm, rewrites)
    if any(n.target is op for n in gm.graph.nodes):
        raise AssertionError(f"{op} was not rewritten")
    return gm, tensors
