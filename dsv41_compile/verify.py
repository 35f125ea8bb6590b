"""verify: re-run fake propagation on the per-rank graph and check what the layout promises.

Requires: localize (and expert_parallel, graph_mode when they run). Ensures: every node's value
(`meta["val"]`) is the local one, computed by fake-tensor propagation from local inputs; each
annotated node's local shape is its global shape with sharded dims divided over tp (expert dims
over ep); the graph lints; the layout's invariants hold; `ctx.comm` holds one record per
collective (`report.comm.comm_records`).

Placements first, before any shape is computed: every annotated node gets each input in the
placement it needs (`meta[IN]` against the producer's `meta[OUT]`). This is what catches the
bugs hand-written SP keeps shipping: a partial sum used before its reduction (or scattered
without one), a sum collective over replicated copies (x tp), a rank's token shard paired with
gathered tokens (the token order would not match the positions), the EP dispatch of tokens
every TP rank holds (x tp assignments).

Then the invariants: the model adapter's promise per decoder layer
(`ModelAdapter.expected_collectives`: which TP collectives a layer has outside its MoE half and
in it, the rank of the values it gathers -- or, where the entry cut moved the gather, exactly
the cut's values, one AllGather each), plus what holds in every layout: every reduction
(reduce-scatter, all-reduce) runs on fp32; no all-reduce in the sp layout; EP collectives are
all-to-alls inside a MoE half, as many per MoE layer as the dispatch lowering makes. A broken
invariant is an `InternalError` naming the node.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import snapshot_fake
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dsv41_compile.core.collectives import collective_axis, collective_kind, dispatched_values
from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.meta import (
    GLOBAL_VAL,
    IN,
    OUT,
    REGION,
    TABLE,
    Unkeyed,
    metadata_key,
    tensor_inputs,
)
from dsv41_compile.core.placements import ColumnShard, ExpertShard, format_placement
from dsv41_compile.core.symbols import hint_shape, new_unbacked_symbols
from dsv41_compile.core.torch_private import (
    FakeTensorMode,
    OpOverload,
    enable_python_dispatcher,
    tree_map_only,
)
from dsv41_compile.moe.stats import ALL_TO_ALLS, ep_layers
from dsv41_compile.report.comm import comm_records
from dsv41_compile.spmd.entry_cut import entry_cuts

__all__ = ["verify"]


def verify(gm: GraphModule, *, ctx: CompileContext) -> None:
    gm.graph.lint()
    _check_placements(gm, ctx)
    with enable_python_dispatcher():  # the decompositions that take symbolic sizes
        _OnceProp(gm, mode=ctx.fake_mode).propagate_dont_convert_inputs(*ctx.local_inputs(gm))
    _check_reduction_dtypes(gm)
    _check_local_shapes(gm, ctx)
    ctx.comm[:] = comm_records(gm, ctx)
    _check_layout(gm, ctx)


_REDUCTIONS = ("reduce_scatter", "all_reduce")


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
        if not isinstance(target, OpOverload) or target._schema.is_mutable:
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


def _placement(node: Node) -> object:
    return node.meta.get(OUT)


def _check_placements(gm: GraphModule, ctx: CompileContext) -> None:
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind in _REDUCTIONS and collective_axis(node, ctx.mesh) == "tp":
            _check_reduction(node, kind)
        if isinstance(_placement(node), Partial):
            for user in node.users:
                if not _on_the_way_to_a_reduction(user):
                    raise InternalError(_partial_use(node, user), user)
        needed = node.meta.get(IN)
        if not needed or node.op != "call_function":
            continue
        for producer, need in zip(tensor_inputs(node), needed):
            have = _placement(producer)
            if have != need and not isinstance(have, Partial):
                raise InternalError(
                    f"{node.name} needs {producer.name} as {format_placement(need)} but gets "
                    f"{format_placement(have)}{_mismatch(have, need)}",
                    node,
                )
    for node in dispatched_values(gm):
        if _placement(node) != Shard(0):
            raise InternalError(
                f"the EP dispatch sends {node.name}, which is "
                f"{format_placement(_placement(node))}: every rank of the TP group holds the "
                "same rows and would dispatch them (tp times the assignments); the routed "
                "experts take each rank's token shard (S(0))",
                node,
            )


def _check_reduction(node: Node, kind: str) -> None:
    """A reduction over tp sums the fp32 partial sum the model computed, nothing else."""
    source = node.args[0]
    while _on_the_way_to_a_reduction(source) and collective_kind(source) is None:
        source = source.args[0]
    if not isinstance(_placement(source), Partial):
        raise InternalError(
            f"a {kind} sums {source.name} over tp, but {source.name} is "
            f"{format_placement(_placement(source))}, not a partial sum: every rank holds its "
            "own copy, and their sum is tp times the value",
            node,
        )


def _check_reduction_dtypes(gm: GraphModule) -> None:
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        dtype = node.args[0].meta["val"].dtype if kind in _REDUCTIONS else torch.float32
        if dtype != torch.float32:
            raise InternalError(
                f"a {kind} reduces {dtype}; reductions run on the fp32 partial sum the model "
                "computed (a rounded copy would be summed in another precision)",
                node,
            )


_WAY_TO_A_REDUCTION = {
    torch.ops.aten.constant_pad_nd.default,  # the token padding of a reduce-scatter
    torch.ops.aten._to_copy.default,  # a cast: the dtype check then names it
}


def _on_the_way_to_a_reduction(node: Node) -> bool:
    """`node` is a reduction collective, or a pad or cast whose users all are."""
    if collective_kind(node) in _REDUCTIONS:
        return True
    return node.target in _WAY_TO_A_REDUCTION and all(
        _on_the_way_to_a_reduction(user) for user in node.users
    )


def _partial_use(partial: Node, user: Node) -> str:
    kinds = {u.target for u in user.users}
    if user.target is torch.ops.aten.constant_pad_nd.default and (
        torch.ops.aten.unflatten.int in kinds
    ):
        return (
            f"{user.name} slices the partial sum {partial.name} (P) into this rank's token "
            "shard without reducing it: each rank would keep only its share of the sum"
        )
    return (
        f"{user.name} uses the partial sum {partial.name} (P) before its reduction: each rank "
        "holds only its share of the sum"
    )


def _mismatch(have: object, need: object) -> str:
    if have == Shard(0) and isinstance(need, Replicate):
        return (
            ": this rank's token shard where every token is needed (paired with gathered "
            "tokens, the token order would not match)"
        )
    return ""


def _check_local_shapes(gm: GraphModule, ctx: CompileContext) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    shards = {placeholders[i].name: s for i, s in ctx.signature.param_shards.items()}
    for node in gm.graph.nodes:
        global_val, placement = node.meta.get(GLOBAL_VAL), node.meta.get(OUT)
        val = node.meta.get("val")
        if not isinstance(global_val, torch.Tensor) or not isinstance(val, torch.Tensor):
            continue
        expected = list(hint_shape(global_val))
        if isinstance(placement, ColumnShard):  # a table split by columns: its longest range
            expected = shards[node.name].local_shape(expected)
        elif isinstance(placement, (Shard, ExpertShard)):
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
        if kind == "all_reduce" and not isinstance(ctx.plan.partial_to, Replicate):
            raise InternalError(
                f"an all-reduce in the {layout} layout, whose plan reduce-scatters its partial "
                "sums to token shards",
                node,
            )
        if collective_axis(node, ctx.mesh) == "ep":
            lookup = node.meta.get(TABLE, False)
            if kind != "all_to_all" or (site.part != "moe" and not lookup):
                raise InternalError(f"an EP {kind} outside a MoE half or a table lookup", node)
            ep_by_region[node.meta[REGION]] += site.part == "moe"
        elif site.layer is not None:
            tp_by_layer[site.layer][site.part == "moe"].append(node)
    cuts = {ctx.adapter.site(region).layer: cut for region, cut in entry_cuts(ctx).items()}
    for layer in sorted(_decoder_layers(ctx)):
        outside = list(promise.tp_outside_moe)
        cut = cuts.get(layer)
        if cut is not None and cut.sharded:  # the entry gathers the cut's values instead
            outside.remove("all_gather")
            outside += ["all_gather"] * len(cut.gathered)
        for node in tp_by_layer[layer][False]:
            if collective_kind(node) != "all_gather":
                continue
            if cut is not None and cut.sharded:
                if node.args[0] not in cut.gathered:
                    raise InternalError(
                        f"layer {layer} gathers {node.args[0].name}, not one of its entry cut's "
                        f"values {[n.name for n in cut.gathered]}",
                        node,
                    )
                continue
            ndim = node.args[0].meta["val"].dim()
            if promise.gathered_ndim not in (None, ndim):
                raise InternalError(
                    f"{layout} layout: layer {layer} gathers a {ndim}-D value, expected the "
                    f"{promise.gathered_ndim}-D layer input (the residual streams stay "
                    "token-sharded across layers)",
                    node,
                )
        for in_moe, expected, half in (
            (False, outside, "outside its MoE half"),
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
    expected_a2a = ALL_TO_ALLS[ctx.options.ep_dispatch]
    for info in ep_layers(ctx):
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
