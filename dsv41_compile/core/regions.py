"""Compiled regions: a repeated module traced once per kind, copied in at every instance.

A model may mark a repeated module a compiled region (`torch.compiler.nested_compile_region`;
DeepSeek V4.1's decoder layer). Dynamo then traces each distinct kind of it once and calls the
traced subgraph at every instance of the kind, with the instance's weights as operands;
AOTAutograd turns each subgraph into ATen once (its `invoke_subgraph` cache), and writes of
the region into its inputs (the cache) become `auto_functionalized_v2(invoke_subgraph, ...)`.

The passes place and rewrite one flat graph, so the regions are copied in at every call,
after AOTAutograd (`inline_regions`, the pipeline's first pass): each copy takes the call's
operands and moves every node's module path from the instance the kind was traced at
(`layers.3`) to the call's (`layers.5`), which is what the placements, the per-layer checks and
the dumps read (`core.meta.module_paths`). For the ATen nodes of a region to carry module paths
at all, AOTAutograd must trace the region node by node (`trace_regions_with_meta`). A graph
Dynamo traced with a static token count is copied in before AOTAutograd instead
(`inline_dynamo_regions`): making its count symbolic reads every op of the graph.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx.traceback as fx_traceback
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph
from torch.fx import GraphModule, Interpreter, Node

from dsv41_compile.core.errors import InternalError

if TYPE_CHECKING:
    from dsv41_compile.core.context import CompileContext

__all__ = ["inline_dynamo_regions", "inline_regions", "region_calls", "trace_regions_with_meta"]

aten = torch.ops.aten


def region_calls(gm: GraphModule) -> list[Node]:
    """The calls of compiled regions in `gm` (Dynamo's or AOTAutograd's graph)."""
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and (
            n.target is invoke_subgraph
            or (n.target is auto_functionalized_v2 and n.args[0] is invoke_subgraph)
        )
    ]


def inline_dynamo_regions(gm: GraphModule) -> int:
    """Replace every region call in Dynamo's graph by the region's nodes; return how many calls
    there were."""
    return _inline_calls(gm)


def inline_regions(gm: GraphModule, *, ctx: CompileContext | None = None) -> None:
    """The pass: every region call of the AOT graph replaced by the region's ATen nodes.

    Requires: the AOT inference graph; regions traced by `trace_regions_with_meta`.
    Ensures: no region call is left; each copied node has the module path of its call's
    instance; a region's writes into its inputs become the values the call returned for them
    (as `auto_functionalized_v2` defines them), so the graph is the functional graph of the
    model without regions."""
    _inline_calls(gm)


def _inline_calls(gm: GraphModule) -> int:
    calls = region_calls(gm)
    for call in calls:
        _inline(gm, call, *_body_and_operands(gm, call))
    _tidy(gm, calls)
    return len(calls)


def _body_and_operands(gm: GraphModule, call: Node) -> tuple[GraphModule, list[Any], list[Node]]:
    """The region a call runs, its operands (a `_Written` for an input the region writes) and
    the call's bases (`auto_functionalized_v2`'s `_all_bases`; none for a plain call)."""
    if call.target is invoke_subgraph:
        attr, _identifier, *operands = call.args
        return getattr(gm, attr.target), list(operands), []
    kwargs = call.kwargs
    body = getattr(gm, kwargs["subgraph"].target)
    bases = list(kwargs["_all_bases"])
    operands: list[Any] = []
    for i, _ in enumerate(n for n in body.graph.nodes if n.op == "placeholder"):
        if f"arg{i}" in kwargs:
            operands.append(kwargs[f"arg{i}"])
            continue
        view = [k for k in ("size", "stride", "storage_offset", "slice_dim")
                if f"_arg{i}_{k}" in kwargs]  # fmt: skip
        index = kwargs.get(f"_arg{i}_base_index")
        if view or not isinstance(index, int):
            raise InternalError(
                f"a region writes its input {i} through a view ({view or index}), which "
                "inline_regions does not copy",
                call,
            )
        operands.append(_Written(bases[index], index))
    return body, operands, bases


class _Written:
    """An input the region writes: base `index` of the call's `_all_bases`."""

    def __init__(self, base: Node, index: int) -> None:
        self.base, self.index = base, index


def _inline(
    gm: GraphModule, call: Node, body: GraphModule, operands: list[Any], bases: list[Node]
) -> None:
    graph = gm.graph
    inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(inputs) != len(operands):
        raise InternalError(
            f"region takes {len(inputs)} inputs, its call passes {len(operands)}", call
        )
    written = {p: o for p, o in zip(inputs, operands) if isinstance(o, _Written)}
    env: dict[Node, Any] = {
        p: o.base if isinstance(o, _Written) else o for p, o in zip(inputs, operands)
    }
    new_bases: list[Any] = list(bases)
    stored: set[Node] = set()  # written inputs whose write has been met
    moved = _instance_move(call, body)
    results: tuple[Any, ...] = ()
    with graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                results = tuple(env.get(r, r) for r in node.args[0])
                continue
            if any(a in stored for a in node.all_input_nodes):
                raise InternalError(f"{node.name} reads a region's input after its write", call)
            if node.target is aten.copy_.default and node.args[0] in written:
                # the region's write into its input: the value the call returns for that base
                new_bases[written[node.args[0]].index] = env[node.args[1]]
                stored.add(node.args[0])
                continue
            if node.op not in ("call_function", "call_method") or node.target in (
                invoke_subgraph,
                auto_functionalized_v2,
            ):
                raise InternalError(
                    f"a region holds a {node.op} node {node.name} ({node.target}) that "
                    "inline_regions does not copy",
                    call,
                )
            if any(a in written for a in node.all_input_nodes) and not _reads_only(node):
                raise InternalError(f"a region writes its input in {node.name}", call)
            copy = graph.node_copy(node, env.__getitem__)
            copy.meta = {**node.meta, **moved(node)}
            env[node] = copy
    returned = [*results, *new_bases] if call.target is auto_functionalized_v2 else results
    for user in list(call.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise InternalError(f"a region's result is used whole by {user.name}", call)
        user.replace_all_uses_with(returned[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(call)


def _reads_only(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is None or not schema.is_mutable


def _tidy(gm: GraphModule, calls: list[Node]) -> None:
    """Drop the regions' subgraphs the calls left unused."""
    if not calls:
        return
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    gm.recompile()


def _instance_move(call: Node, body: GraphModule) -> Callable[[Node], dict[str, Any]]:
    """The meta update that moves a node of `body` from the instance it was traced at to the
    instance `call` calls it at: each module path under the traced instance's path is put under
    the call's (`L['self'].layers.3.attn` -> `L['self'].layers.5.attn`)."""
    site_stack = call.meta.get("nn_module_stack") or {}
    if not site_stack:
        raise InternalError("a region call without its module path", call)
    site, site_cls = list(site_stack.values())[-1]
    traced = next(
        (
            list(stack.values())[len(site_stack) - 1]
            for stack in (n.meta.get("nn_module_stack") for n in body.graph.nodes)
            if stack and len(stack) >= len(site_stack)
        ),
        None,
    )
    if traced is None or traced[1] is not site_cls:
        raise InternalError(
            f"region traced at {traced}, called at {site} ({site_cls.__name__}): its nodes "
            "carry no module path of the region (was it traced by trace_regions_with_meta?)",
            call,
        )
    origin = traced[0]

    def moved(node: Node) -> dict[str, Any]:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            return {}
        return {
            "nn_module_stack": {
                f"{key}@{site}": (
                    site + path[len(origin) :]
                    if path == origin or path.startswith(origin + ".")
                    else path,
                    cls,
                )
                for key, (path, cls) in stack.items()
            }
        }

    return moved


def trace_regions_with_meta(gm: GraphModule) -> None:
    """Make AOTAutograd trace each region of Dynamo's graph `gm` node by node. (It traces the
    main graph that way; a region it calls as a function, and its ATen nodes would carry the
    call's module path only.)"""
    for call in region_calls(gm):
        body = getattr(gm, call.args[0].target)
        if isinstance(body, GraphModule):
            body.forward = _node_by_node(body)  # type: ignore[method-assign]


def _node_by_node(body: GraphModule) -> Callable[..., Any]:
    def forward(*args: Any) -> Any:
        with fx_traceback.preserve_node_meta():
            return Interpreter(body).run(*args)

    return forward
