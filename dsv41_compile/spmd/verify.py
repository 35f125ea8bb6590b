"""verify: re-run fake propagation on the per-rank graph and check what the layout promises.

Requires: localize (and expert_parallel, graph_mode when they run). Ensures: every node's value
(`meta["val"]`) is the local one, computed by fake-tensor propagation from local inputs; each
annotated node's local shape is its global shape with sharded dims divided over tp (expert dims
over ep); the graph lints; the layout's invariants hold; `ctx.comm` holds one record per
collective (`report.comm.comm_records`).

The invariants are the model adapter's promise per decoder layer
(`ModelAdapter.expected_collectives`: which TP collectives a layer has outside its MoE half and
in it, the rank of the values it gathers), plus what holds in every layout: every reduction
(reduce-scatter, all-reduce) runs on fp32; no all-reduce in the sp layout; EP collectives are
all-to-alls inside a MoE half, as many per MoE layer as the dispatch lowering makes. A broken
invariant is an `InternalError` naming the node.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import Shard
from torch.fx import GraphModule, Node
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.meta import GLOBAL_VAL, OUT, REGION
from dsv41_compile.core.symbols import hint_shape
from dsv41_compile.moe.stats import ALL_TO_ALLS
from dsv41_compile.report.comm import collective_axis, collective_kind, comm_records
from dsv41_compile.spmd.localize import local_inputs
from dsv41_compile.spmd.placements import ExpertShard, format_placement

__all__ = ["verify"]


def verify(gm: GraphModule, *, ctx: CompileContext) -> None:
    gm.graph.lint()
    FakeTensorProp(gm, mode=ctx.fake_mode).propagate_dont_convert_inputs(*local_inputs(gm, ctx))
    _check_local_shapes(gm, ctx)
    ctx.comm[:] = comm_records(gm, ctx)
    _check_layout(gm, ctx)


def _check_local_shapes(gm: GraphModule, ctx: CompileContext) -> None:
    for node in gm.graph.nodes:
        global_val, placement = node.meta.get(GLOBAL_VAL), node.meta.get(OUT)
        val = node.meta.get("val")
        if not isinstance(global_val, torch.Tensor) or not isinstance(val, torch.Tensor):
            continue
        expected = list(hint_shape(global_val))
        if isinstance(placement, (Shard, ExpertShard)):
            parts = ctx.mesh.ep if isinstance(placement, ExpertShard) else ctx.mesh.tp
            expected[placement.dim] = -(-expected[placement.dim] // parts)  # padded chunks
        actual = list(hint_shape(val))
        if actual != expected:
            raise InternalError(
                f"placed {format_placement(placement)}, the local shape is {actual} where the "
                f"global shape {list(hint_shape(global_val))} gives {expected}",
                node,
            )


def _check_layout(gm: GraphModule, ctx: CompileContext) -> None:
    layout = ctx.options.layout
    promise = ctx.adapter.expected_collectives(ctx.options)
    tp_by_layer: dict[int, dict[bool, list[Node]]] = defaultdict(lambda: {False: [], True: []})
    ep_by_region: dict[str, int] = defaultdict(int)
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        site = ctx.adapter.site(node.meta.get(REGION, ""))
        if kind in ("reduce_scatter", "all_reduce"):
            dtype = node.args[0].meta["val"].dtype
            if dtype != torch.float32:
                raise InternalError(f"a {kind} reduces {dtype}; reductions run on fp32", node)
        if kind == "all_reduce" and layout == "sp":
            raise InternalError("the sp layout has no all-reduce", node)
        if collective_axis(node, ctx) == "ep":
            if kind != "all_to_all" or site.part != "moe":
                raise InternalError(f"an EP {kind} outside a MoE half", node)
            ep_by_region[node.meta[REGION]] += 1
        elif site.layer is not None:
            tp_by_layer[site.layer][site.part == "moe"].append(node)
    for layer in sorted(_decoder_layers(ctx)):
        for in_moe, expected, half in (
            (False, promise.tp_outside_moe, "outside its MoE half"),
            (True, promise.tp_in_moe, "in its MoE half"),
        ):
            nodes = tp_by_layer[layer][in_moe]
            kinds = tuple(sorted(collective_kind(n) for n in nodes))
            if kinds != tuple(sorted(expected)):
                raise InternalError(
                    f"{layout} layout: layer {layer} has TP collectives {list(kinds)} {half}, "
                    f"expected {sorted(expected)}",
                    nodes[0] if nodes else None,
                )
        for node in tp_by_layer[layer][False]:
            ndim = node.args[0].meta["val"].dim()
            if collective_kind(node) == "all_gather" and promise.gathered_ndim not in (None, ndim):
                raise InternalError(
                    f"{layout} layout: layer {layer} gathers a {ndim}-D value, expected "
                    f"{promise.gathered_ndim}-D",
                    node,
                )
    expected_a2a = ALL_TO_ALLS[ctx.options.ep_dispatch]
    for info in ctx.ep_layers:
        if ep_by_region[info.region] != expected_a2a:
            raise InternalError(
                f"{info.region} has {ep_by_region[info.region]} EP all-to-alls, expected "
                f"{expected_a2a} ({ctx.options.ep_dispatch} dispatch)"
            )


def _decoder_layers(ctx: CompileContext) -> set[int]:
    layers = set()
    for fqn in ctx.param_fqns.values():
        layer = ctx.adapter.site(fqn.rsplit(".", 1)[0]).layer
        if layer is not None:
            layers.add(layer)
    return layers
