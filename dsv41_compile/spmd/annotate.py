"""annotate: give every value a placement on the tp axis; change no node.

Requires: the AOT inference graph (ATen ops, parameters as placeholders named in `ctx`).
Refuses: a plan with a pattern that matches nothing in the model (`ShardingPlan.check_matches`).
Ensures: every node has `meta[OUT]` (its output placement(s)), every node with tensor inputs has
`meta[IN]` (the placement each tensor input must have; the insert pass makes it so), `meta[RULE]`
and `meta[REGION]`.

Sources of placements, in order: the plan's parameter placements; the plan's exits and anchors
(an activation leaving a module with an exit placement takes it, then one entering an anchored
module takes the anchor's); a partial sum is redistributed before any use -- one with a token
dim to the plan's `partial_to` (reduce-scattered to token shards in `sp`, all-reduced in
`replicated`), one without (a sum over the tokens: a statistic) all-reduced -- so the reduction
always runs on the partial the model computed, never on a rounded or transformed copy; then the
op rules (`spmd.rules`, the ops along the token dim in `spmd.token_ops`).
"""

from __future__ import annotations

import operator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.fx import GraphModule, Node

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.meta import (
    GLOBAL_VAL,
    IN,
    OUT,
    REGION,
    RULE,
    describe,
    module_paths,
    tensor_inputs,
)
from dsv41_compile.core.placements import ExpertShard, format_placement
from dsv41_compile.core.symbols import is_token_count
from dsv41_compile.spmd.rules import reads_an_unsplit_dim, rule_answers, strategy_for

__all__ = ["annotate", "exit_placement", "partial_goes_to"]


def _output_placement(node: Node) -> Placement:
    out = node.meta[OUT]
    if isinstance(out, tuple):
        raise InternalError("a multi-output value is used whole; expected getitem", node)
    return out


def annotate(gm: GraphModule, *, ctx: CompileContext) -> None:
    mesh, plan = ctx.mesh.tp_mesh, ctx.plan
    plan.check_matches(
        ctx.param_fqns.values(), (p for n in gm.graph.nodes for p in module_paths(n))
    )
    parameters: dict[Node, Node] = {}  # value -> the parameter it is computed from alone
    for node in gm.graph.nodes:
        _note_parameter(node, ctx, parameters)
        node.meta[GLOBAL_VAL] = node.meta.get("val")
        paths = module_paths(node)
        anchored = plan.anchor(paths)
        node.meta[REGION] = anchored[0] if anchored else ""
        if node.op == "placeholder":
            _annotate_placeholder(node, ctx)
        elif node.op == "call_function" and node.target is operator.getitem:
            node.meta[OUT] = node.args[0].meta[OUT][node.args[1]]
            node.meta[RULE] = "getitem"
        elif node.op == "call_function":
            _annotate_call(node, ctx, mesh, anchored, parameters)
        elif node.op == "output":
            inputs = tensor_inputs(node)
            node.meta[IN] = tuple(Replicate() for _ in inputs)
            node.meta[RULE] = "graph outputs are replicated over tp"
        else:
            raise InternalError(f"unexpected {node.op} node in an AOT graph", node)


def _annotate_placeholder(node: Node, ctx: CompileContext) -> None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        node.meta[OUT] = None
        node.meta[RULE] = "symbolic size"
        return
    fqn = ctx.param_fqns.get(node.name)
    if fqn is None:
        node.meta[OUT] = Replicate()
        node.meta[RULE] = (
            f"model input {ctx.input_sources.get(node.name, node.name)}: every rank of the TP group holds it"
        )
        return
    placement = ctx.plan.param_placement(fqn)
    if isinstance(placement, (Shard, ExpertShard)):
        size = val.shape[placement.dim]
        parts = ctx.mesh.ep if isinstance(placement, ExpertShard) else ctx.mesh.tp
        if not isinstance(size, int) or size % parts:
            advice = ctx.adapter.tp_advice(size)
            raise ValueError(_indivisible(fqn, list(val.shape), placement, parts, advice))
    node.meta[OUT] = placement
    node.meta[RULE] = f"plan: {fqn}"


def _indivisible(
    fqn: str, shape: list, placement: Shard | ExpertShard, parts: int, advice: str
) -> str:
    size = shape[placement.dim]
    if isinstance(placement, ExpertShard):
        return (
            f"ep={parts} does not divide the {size} routed experts of {fqn}: every rank must "
            f"hold the same number of experts; use a model whose n_routed_experts is a "
            f"multiple of ep, or ep=1"
        )
    return (
        f"the plan shards {fqn} (shape {shape}) on dim {placement.dim} over tp={parts}, which "
        f"does not divide {size}; {advice}"
    )


def _annotate_call(
    node: Node,
    ctx: CompileContext,
    mesh: DeviceMesh,
    anchored: tuple[str, Placement] | None,
    parameters: dict[Node, Node],
) -> None:
    inputs = tensor_inputs(node)
    given: list[Placement] = []
    for producer in inputs:
        placement = _output_placement(producer)
        if not _is_param(producer, ctx):
            placement = exit_placement(producer, node, ctx) or placement
            if anchored is not None and anchored[0] not in module_paths(producer):
                placement = anchored[1]
        if isinstance(placement, Partial):
            placement = partial_goes_to(producer, ctx)
        given.append(placement)

    _check_no_size_of_shard(node, inputs)

    strategy, source = strategy_for(node, given, mesh, ctx.adapter.rules, rule_answers(ctx))
    if len(strategy.inputs) != len(inputs):
        raise InternalError(
            f"the rule gave {len(strategy.inputs)} input placements for {len(inputs)} tensor "
            "inputs",
            node,
        )
    for producer, needed in zip(inputs, strategy.inputs):
        have = _output_placement(producer)
        param = parameters.get(producer)
        if param is not None and needed != have and not isinstance(have, Replicate):
            it = "it"
            if param is not producer:
                it = f"{producer.name}, computed from it ({format_placement(have)}),"
            raise ValueError(
                f"the plan places {ctx.param_fqns[param.name]} as "
                f"{format_placement(param.meta[OUT])}, "
                f"but {describe(node)} needs {it} as {format_placement(needed)} "
                f"(rule {strategy}); the parameter would be re-gathered on every call. If the "
                f"op splits the sharded dim, {ctx.adapter.tp_advice('it')}; otherwise change "
                "the plan or the model so this op sees the shard"
            )
    node.meta[IN] = strategy.inputs
    val = node.meta.get("val")
    outs = strategy.outputs
    node.meta[OUT] = outs if isinstance(val, (tuple, list)) else outs[0]
    node.meta[RULE] = f"{source} {strategy}"


def exit_placement(producer: Node, consumer: Node, ctx: CompileContext) -> Placement | None:
    """The plan's exit placement when `producer`'s value leaves a module with one on its way to
    `consumer`, else None."""
    leaving = ctx.plan.exit(module_paths(producer))
    if leaving is None or leaving[0] in module_paths(consumer):
        return None
    return leaving[1]


def partial_goes_to(node: Node, ctx: CompileContext) -> Placement:
    """Where a partial sum of `node` goes before its first use: the plan's `partial_to` when
    its value has the token dim first, else replicated (a sum over the tokens)."""
    return ctx.plan.partial_to if _has_tokens(node) else Replicate()


def _has_tokens(node: Node) -> bool:
    """Whether `node`'s value has the token dim first (a partial of it goes to `partial_to`)."""
    val = node.meta.get(GLOBAL_VAL, node.meta.get("val"))
    return isinstance(val, torch.Tensor) and val.dim() > 0 and is_token_count(val.shape[0])


def _is_param(node: Node, ctx: CompileContext) -> bool:
    return node.op == "placeholder" and node.name in ctx.param_fqns


def _note_parameter(node: Node, ctx: CompileContext, parameters: dict[Node, Node]) -> None:
    """Note in `parameters` the parameter `node`'s value is computed from alone (the
    parameter, a view or transpose of it: every tensor input a parameter or computed from
    them); an activation is not noted. Nodes come in graph order."""
    if _is_param(node, ctx):
        parameters[node] = node
    elif node.op == "call_function" and node.target is not operator.getitem:
        inputs = tensor_inputs(node)
        if inputs and all(p in parameters for p in inputs):
            parameters[node] = parameters[inputs[0]]


def _check_no_size_of_shard(node: Node, inputs: list[Node]) -> None:
    # A size read from a sharded tensor would be the local size after localization; a size of
    # a dim the tensor is not split along is the same on every rank (e.g. the keys of a
    # head-sharded attention, which a symbolic cache length makes a symbol).
    if node.target in (torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default):
        placement = _output_placement(inputs[0])
        if isinstance(placement, Replicate) or reads_an_unsplit_dim(node, placement):
            return
        raise NotImplementedError(
            f"{describe(node)} reads a size of a {format_placement(placement)} tensor"
        )
