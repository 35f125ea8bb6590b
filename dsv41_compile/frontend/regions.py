"""Compiled regions: a repeated module traced once per kind, copied in at every instance.

A model may mark a repeated module a compiled region (`torch.compiler.nested_compile_region`;
DeepSeek V4.1's decoder layer). Dynamo then traces each distinct kind of it once and calls the
traced subgraph at every instance of the kind, with the instance's weights as operands.

AOTAutograd would turn each subgraph into ATen once (its `invoke_subgraph` cache) but still
functionalize and fake-run the subgraph at every call, twice: at flash sizes about 1.6 s per
layer. So the backend traces each kind's ATen itself, once, on the operands of its first call
(`trace_kinds_once`), and replaces the kind's calls by an operator of this compile whose fake
kernel returns that trace's outputs; AOTAutograd sees one operator per layer, and writes of the
region into its inputs (the cache) become `auto_functionalized_v2(kind, ...)`. A kind whose
outputs have sizes of their own per call (data-dependent) stays an `invoke_subgraph` call.

The passes place and rewrite one flat graph, so the regions are copied in at every call,
after AOTAutograd (`inline_regions`, the front porch's last step): each copy takes the call's
operands and moves every node's module path from the instance the kind was traced at
(`layers.3`) to the call's (`layers.5`), which is what the placements, the per-layer checks and
the dumps read (`core.meta.module_paths`). For the ATen nodes of a region to carry module paths
at all, it must be traced node by node (`trace_regions_with_meta`). A graph Dynamo traced with a
static token count is copied in before AOTAutograd instead (`inline_dynamo_regions`): making its
count symbolic reads every op of the graph. The copies of a kind are the same operators on
inputs of the same metadata, which verify's fake propagation exploits (`verify`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.fx.traceback as fx_traceback
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.experimental.symbolic_shapes import free_symbols

from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.meta import Unkeyed, metadata_key
from dsv41_compile.core.symbols import new_unbacked_symbols, size_expr
from dsv41_compile.core.torch_private import (
    FakeTensor,
    OpOverload,
    TracingContext,
    aot_module_simplified,
    auto_functionalized_v2,
    destroy_library,
    detect_fake_mode,
    invoke_subgraph,
    op_schema,
    op_short_name,
    size_of,
    sym_expr,
    sym_shape_env,
    tracing,
)

__all__ = [
    "RegionKinds",
    "inline_dynamo_regions",
    "inline_regions",
    "region_calls",
    "renamed_symbols",
    "trace_kinds_once",
    "trace_regions_with_meta",
]

aten = torch.ops.aten


def region_calls(gm: GraphModule) -> list[Node]:
    """The calls of compiled regions in `gm` (Dynamo's or AOTAutograd's graph)."""
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and (_is_region(n.target) or (n.target is auto_functionalized_v2 and _is_region(n.args[0])))
    ]


def _is_region(target: Any) -> bool:
    """`invoke_subgraph`, or a kind's operator (`trace_kinds_once`)."""
    return target is invoke_subgraph or (
        isinstance(target, OpOverload) and target.namespace == _NAMESPACE
    )


def inline_dynamo_regions(gm: GraphModule) -> int:
    """Replace every region call in Dynamo's graph by the region's nodes; return how many calls
    there were."""
    return _inline_calls(gm)


def inline_regions(gm: GraphModule) -> None:
    """Every region call of the AOT graph replaced by the region's ATen nodes.

    Requires: the AOT inference graph; regions traced by `trace_regions_with_meta`, each kind's
    ATen graph attached under its operator's name (`RegionKinds.attach`).
    Ensures: no region call is left; each copied node has the module path of its call's
    instance; a region's writes into its inputs become the values the call returned for them
    (as `auto_functionalized_v2` defines them), so the graph is the functional graph of the
    model without regions."""
    _inline_calls(gm)


def _inline_calls(gm: GraphModule) -> int:
    calls = region_calls(gm)
    for call in calls:
        _inline(gm, call, *_body_and_operands(gm, call))
    if calls:
        _tidy(gm)
    return len(calls)


def _body_and_operands(gm: GraphModule, call: Node) -> tuple[GraphModule, list[Any], list[Node]]:
    """The region a call runs, its operands (a `_Written` for an input the region writes) and
    the call's bases (`auto_functionalized_v2`'s `_all_bases`; none for a plain call)."""
    if call.target is invoke_subgraph:
        attr, _identifier, *passed = call.args
        return getattr(gm, cast(str, attr.target)), list(passed), []
    if call.target is not auto_functionalized_v2:  # a kind's operator
        return getattr(gm, op_short_name(cast(OpOverload, call.target))), list(call.args), []
    kwargs = call.kwargs
    op = call.args[0]
    body = getattr(
        gm,
        cast(str, kwargs["subgraph"].target)
        if op is invoke_subgraph
        else op_short_name(cast(OpOverload, op)),
    )
    bases = list(cast(Sequence[Node], kwargs["_all_bases"]))
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
    if isinstance(call.target, OpOverload) and len(op_schema(call.target).returns) == 1:
        call.replace_all_uses_with(returned[0])  # a kind's operator returns one output bare
    for user in list(call.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise InternalError(f"a region's result is used whole by {user.name}", call)
        user.replace_all_uses_with(returned[cast(int, user.args[1])])
        graph.erase_node(user)
    graph.erase_node(call)


def _reads_only(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is None or not schema.is_mutable


def _tidy(gm: GraphModule) -> None:
    """Drop the regions' subgraphs the calls left unused."""
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
        body = getattr(gm, cast(str, call.args[0].target))
        if isinstance(body, GraphModule):
            body.forward = _node_by_node(body)  # type: ignore[method-assign]


def _node_by_node(body: GraphModule) -> Callable[..., Any]:
    def forward(*args: Any) -> Any:
        with fx_traceback.preserve_node_meta():
            return Interpreter(body).run(*args)

    return forward


# --- each kind's ATen traced once -------------------------------------------------------------

_NAMESPACE = "dsv41_regions"
_kind_count = 0


class RegionKinds:
    """The kinds of a Dynamo graph's regions, each traced to ATen once (`trace_kinds_once`).

    Each kind is an operator `dsv41_regions::kind_N` of this compile (its schema: the region's
    operands, the inputs it writes marked mutable) whose fake kernel returns the outputs the
    kind's one ATen trace returned: AOTAutograd then traces the model with the calls as
    single operators, where it would functionalize and fake-run the region's body at every
    call. `attach` hands the ATen bodies to the AOT graph for `inline_regions`; `close`
    unregisters the operators."""

    def __init__(self) -> None:
        self.library = torch.library.Library(_NAMESPACE, "FRAGMENT")
        self.bodies: dict[str, GraphModule] = {}
        """Operator name (`kind_3`) -> the kind's ATen graph."""

    def attach(self, aten_gm: GraphModule) -> None:
        for name, body in self.bodies.items():
            aten_gm.add_submodule(name, body)

    def close(self) -> None:
        destroy_library(self.library)


def trace_kinds_once(
    gm: GraphModule,
    renamed: dict[Any, Any] | None = None,
    decompositions: dict[Any, Callable[..., Any]] | None = None,
) -> RegionKinds:
    """Trace each kind of region in Dynamo's graph `gm` to ATen once and replace its calls by
    the kind's operator (`RegionKinds`). Calls of one region whose operands differ in shape,
    stride or dtype are kinds of their own. A call with an operand whose data matters (a
    constant) or of a region whose outputs have data-dependent sizes stays an `invoke_subgraph`
    call (AOTAutograd traces it at every call).

    The operands are traced as Dynamo saw them (its example values), with the size symbols in
    `renamed` replaced (the backend's token count: Dynamo's backed symbol -> the unbacked one
    AOTAutograd traces with, `frontend.tokens.generalized`); the ops of `decompositions` as
    their decompositions (`frontend.trace.trace`)."""
    kinds = RegionKinds()
    traced: dict[tuple[Any, ...], Any] = {}
    for call in region_calls(gm):
        attr, _identifier, *operands = call.args
        values = [
            _renamed(o.meta["example_value"], renamed or {}) if isinstance(o, Node) else o
            for o in operands
        ]
        try:
            key = (attr.target, *(metadata_key(v) for v in values))
        except Unkeyed:
            continue  # an operand whose data matters: AOTAutograd traces this call itself
        if key not in traced:
            body = getattr(gm, cast(str, attr.target))
            traced[key] = _trace_kind(kinds, body, values, decompositions or {})
        op = traced[key]
        if op is None:
            continue
        with gm.graph.inserting_before(call):
            new = gm.graph.call_function(op, tuple(operands))
        new.meta = dict(call.meta)
        if len(op_schema(op).returns) == 1:  # an operator returns one output bare, not a tuple
            (new.meta["example_value"],) = call.meta["example_value"]
            for user in list(call.users):
                user.replace_all_uses_with(new)
                gm.graph.erase_node(user)
        call.replace_all_uses_with(new)
        gm.graph.erase_node(call)
    if traced:
        _tidy(gm)
    return kinds


def renamed_symbols(before: list[Any], after: list[Any]) -> dict[Any, Any]:
    """The size symbols of graph inputs `before` that `after` replaced: symbol -> expression."""
    renamed: dict[Any, Any] = {}
    for old, new in zip(before, after):
        pairs: list[tuple[int | torch.SymInt, int | torch.SymInt]]
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
            pairs = list(zip(old.shape, new.shape))
        elif isinstance(old, torch.SymInt) and isinstance(new, torch.SymInt):
            pairs = [(old, new)]
        else:
            continue
        for a, b in pairs:
            if (
                isinstance(a, torch.SymInt)
                and isinstance(b, torch.SymInt | int)
                and sym_expr(a).is_Symbol
                and size_expr(b) != sym_expr(a)
            ):
                renamed[sym_expr(a)] = size_expr(b)
    return renamed


def _renamed(value: Any, renamed: dict[Any, Any]) -> Any:
    """`value` (a fake tensor or a size) with the symbols in `renamed` replaced."""
    if not renamed:
        return value
    if isinstance(value, torch.SymInt):
        return _size(value, renamed)
    if not isinstance(value, torch.Tensor) or not free_symbols(value) & renamed.keys():
        return value
    with cast(FakeTensor, value).fake_mode:
        shape = [_size(d, renamed) for d in value.shape]
        return _empty(value, shape, [_size(d, renamed) for d in value.stride()])


def _empty(like: torch.Tensor, shape: Any, stride: Any) -> torch.Tensor:
    """A tensor of `like`'s dtype and device with `shape` and `stride` (in the active mode)."""
    return torch.empty_strided(shape, stride, dtype=like.dtype, device=like.device)


def _size(size: Any, renamed: dict[Any, Any]) -> Any:
    if not isinstance(size, torch.SymInt):
        return size
    expr = sym_expr(size).xreplace(renamed)
    if expr == sym_expr(size):
        return size
    return size_of(sym_shape_env(size), expr)


def _trace_kind(
    kinds: RegionKinds,
    body: GraphModule,
    values: list[Any],
    decompositions: dict[Any, Callable[..., Any]],
) -> Any:
    """The operator of one kind: `body` traced to ATen on `values` (its first call's operands,
    Dynamo's fake values), or None when its outputs have data-dependent sizes of their own."""
    captured: list[GraphModule] = []

    def capture(gm: GraphModule, example_inputs: Sequence[Any]) -> Any:
        captured.append(gm)
        return gm

    with tracing(TracingContext(detect_fake_mode(values))):
        aot_module_simplified(
            body,
            values,
            fw_compiler=capture,
            inference_compiler=capture,
            decompositions=decompositions,
            keep_inference_input_mutations=True,  # its cache writes: copy_ into its inputs
        )
    (traced,) = captured
    inputs = [n for n in traced.graph.nodes if n.op == "placeholder"]
    if len(inputs) != len(values):
        raise InternalError(
            f"a region's ATen trace takes {len(inputs)} inputs where its calls pass "
            f"{len(values)} (aliased operands?)"
        )
    outputs = [o.meta.get("val") for o in traced.graph.output_node().args[0]]
    if new_unbacked_symbols(outputs, values):
        return None  # each call's sizes are its own
    written = {n.args[0] for n in traced.graph.nodes if n.target is aten.copy_.default} & set(
        inputs
    )
    global _kind_count
    _kind_count += 1
    name = f"kind_{_kind_count}"
    params = ", ".join(
        f"{_schema_type(v, f'a{i}' if p in written else None)} arg{i}"
        for i, (p, v) in enumerate(zip(inputs, values))
    )
    returns = ", ".join(_schema_type(o, None) for o in outputs)
    kinds.library.define(f"{name}({params}) -> ({returns})")
    expected = [metadata_key(v) for v in values]

    def fake(*args: Any) -> Any:
        got = [metadata_key(a) for a in args]
        if got != expected:
            i = next(i for i, (g, e) in enumerate(zip(got, expected)) if g != e)
            raise InternalError(
                f"region kind {name} was traced for operand {i} {expected[i]}, a call passes "
                f"{got[i]}"
            )
        made = tuple(
            _empty(o, o.shape, o.stride()) if isinstance(o, torch.Tensor) else o for o in outputs
        )
        return made if len(made) > 1 else made[0]

    torch.library.register_fake(f"{_NAMESPACE}::{name}", fake, lib=kinds.library)
    kinds.bodies[name] = traced
    return getattr(getattr(torch.ops, _NAMESPACE), name).default


def _schema_type(value: Any, alias: str | None) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor({alias}!)" if alias else "Tensor"
    if isinstance(value, (torch.SymInt, int)):
        return "SymInt"
    raise InternalError(f"a region passes a {type(value).__name__}, which a kind cannot take")
