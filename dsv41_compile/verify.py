"""verify: re-run fake propagation on the per-rank graph and check the invariants of any layout.

Requires: localize (and expert_parallel, graph_mode when they run). Ensures: every node's value
(`meta["val"]`) is the local one, computed by fake-tensor propagation from local inputs; each
annotated node's local shape is its global shape with sharded dims divided over tp (expert dims
over ep); the graph lints; the invariants below hold, for any model; `ctx.comm` holds one
record per collective (`report.comm.comm_records`) and `ExtraCollectives` the collectives of
each decoder layer beyond the layout's (`ModelAdapter.expected_collectives`), which `graph.py`
lists with the op that needs each.

Placements first, before any shape is computed: every annotated node gets each input in the
placement it needs (`meta[IN]` against the producer's `meta[OUT]`). This is what catches the
bugs hand-written SP keeps shipping: a partial sum that reaches a non-linear op before its
reduction (or is scattered without one), a sum collective over replicated copies (x tp), a
rank's token shard paired with gathered tokens (the token order would not match the
positions), a partial over the tokens that reads padding rows, the EP dispatch of tokens every
TP rank holds (x tp assignments).

Then what holds in every layout and for every model: a sum over tp runs on fp32 or wider (or
on integers: exact); an all-reduce reduces a value without a token dim where the plan
reduce-scatters partial sums to token shards (a statistic, not a residual); every TP collective
was asked for (a reason naming the op that needs it) and is used; EP collectives are
all-to-alls inside a MoE half, as many per MoE layer as the dispatch lowering makes. A broken
invariant is an `InternalError` naming the node. A program whose TP collectives differ from
the layout's -- a model edited to mix tokens -- is correct as long as these hold; the stock
model's collectives per layer are a regression test (`tests/test_verify.py`).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import GraphModule, Node

from dsv41_compile.core.collectives import (
    collective_axis,
    collective_ends,
    collective_kind,
    dispatched_values,
)
from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.errors import InternalError, as_node
from dsv41_compile.core.fake_prop import propagate_local_values
from dsv41_compile.core.meta import (
    COALESCED,
    GLOBAL_VAL,
    IN,
    OUT,
    REAL_ROWS,
    REASON,
    REGION,
    RULE,
    TABLE,
    source_line,
    tensor_inputs,
)
from dsv41_compile.core.placements import ColumnShard, ExpertShard, format_placement
from dsv41_compile.core.symbols import hint_shape, is_token_count
from dsv41_compile.moe.stats import ALL_TO_ALLS, ep_layers
from dsv41_compile.report.comm import ExtraCollective, ExtraCollectives, comm_records
from dsv41_compile.spmd.entry_cut import entry_cuts

__all__ = ["verify"]

c10d = torch.ops._c10d_functional


def verify(gm: GraphModule, *, ctx: CompileContext) -> None:
    gm.graph.lint()
    if ctx.mesh.tp > 1:  # over a TP group of one rank every placement is the whole value
        _check_placements(gm, ctx)  # (and `spmd.one_rank` removed the collectives between them)
    propagate_local_values(gm, ctx)
    _check_reduction_dtypes(gm)
    _check_local_shapes(gm, ctx)
    ctx.comm[:] = comm_records(gm, ctx)
    _check_collectives(gm, ctx)
    ctx.put(ExtraCollectives(tuple(_extra_collectives(gm, ctx))))


_REDUCTIONS = ("reduce_scatter", "all_reduce")


def _placement(node: Node) -> object:
    return node.meta.get(OUT)


def _check_placements(gm: GraphModule, ctx: CompileContext) -> None:
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind in _REDUCTIONS and collective_axis(node, ctx.mesh) == "tp":
            _check_reduction(node, kind)
        if isinstance(_placement(node), Partial):
            for user in node.users:
                if not _on_the_way_to_a_reduction(user) and not _linear_in_partials(user):
                    raise InternalError(_partial_use(node, user), user)
            if type(_placement(node)) is Partial and not _reads_real_rows(node):
                raise InternalError(
                    f"{node.name} reduces the token shards without setting their padding rows "
                    "to the identity of its reduction: whatever the ops before left in them "
                    "would enter its result",
                    node,
                )
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


_LINEAR = {
    torch.ops.aten.add.Tensor,  # partial + partial, or + a replicated addend counted once
    torch.ops.aten.sub.Tensor,
    torch.ops.aten.addmm.default,  # a bias (rank 0's) plus a row-parallel product
    torch.ops.aten.div.Tensor,  # a partial mean: the sum divided by T
    # a keyed sum (`spmd.token_ops`): self (rank 0's) plus the rank's rows at their keys
    torch.ops.aten.index_add.default,
    torch.ops.aten.scatter_add.default,
    torch.ops.aten.scatter_reduce.two,  # (reduce="sum": its output is a partial sum)
}


def _linear_in_partials(node: Node) -> bool:
    """`node` is linear in its partial inputs and a partial itself, as its rule placed it
    (a sum of partials stays a partial: it is reduced later)."""
    out = _placement(node)
    needed = node.meta.get(IN, ())
    if node.target not in _LINEAR or not isinstance(out, Partial) or out.reduce_op != "sum":
        return False
    return all(
        isinstance(p, Partial) == _is_partial(n) for n, p in zip(tensor_inputs(node), needed)
    )


def _is_partial(node: Node) -> bool:
    return isinstance(_placement(node), Partial)


def _reads_real_rows(node: Node) -> bool:
    """A partial over the token shards reads no padding row: each token shard the reduction
    takes has them set to its identity (`REAL_ROWS`, `spmd.token_ops`)."""
    for producer, need in zip(tensor_inputs(node), node.meta.get(IN, ())):
        if need == Shard(0) and not producer.meta.get(REAL_ROWS) and _has_token_dim(producer):
            return False
    return True


def _has_token_dim(node: Node) -> bool:
    val = node.meta.get(GLOBAL_VAL, node.meta.get("val"))
    return isinstance(val, torch.Tensor) and val.dim() > 0 and is_token_count(val.shape[0])


def _check_reduction(node: Node, kind: str) -> None:
    """A reduction over tp sums the fp32 partial sum the model computed, nothing else."""
    source = as_node(node.args[0], "the value a collective moves")
    while _on_the_way_to_a_reduction(source) and collective_kind(source) is None:
        source = as_node(source.args[0], "the value a collective moves")
    if not isinstance(_placement(source), Partial):
        raise InternalError(
            f"a {kind} sums {source.name} over tp, but {source.name} is "
            f"{format_placement(_placement(source))}, not a partial sum: every rank holds its "
            "own copy, and their sum is tp times the value",
            node,
        )


_SUMMED_IN = (torch.float32, torch.float64, torch.int32, torch.int64)


def _check_reduction_dtypes(gm: GraphModule) -> None:
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind not in _REDUCTIONS or node.args[1] != "sum":
            continue  # a max or a min is exact in any dtype
        dtype = node.args[0].meta["val"].dtype
        if dtype not in _SUMMED_IN:
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


def _check_collectives(gm: GraphModule, ctx: CompileContext) -> None:
    """What holds for the collectives of any model in every layout (the module docstring)."""
    layout = ctx.options.layout
    ep_by_region: dict[str, int] = defaultdict(int)
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        tp = collective_axis(node, ctx.mesh) == "tp"  # EP's: counted per MoE layer below
        if tp and (not node.meta.get(REASON) or not _used(node)):
            detail = "it has no reason" if not node.meta.get(REASON) else "its result is unused"
            raise InternalError(
                f"a collective no op asked for ({kind}: {detail}): every collective is inserted "
                "by a transition or an exchange for the op that needs it, which its reason names",
                node,
            )
        if (
            kind == "all_reduce"
            and not isinstance(ctx.plan.partial_to, Replicate)
            and _reduces_tokens(node)
        ):
            raise InternalError(
                f"an all-reduce of a value with a token dim in the {layout} layout, whose plan "
                "reduce-scatters partial sums to token shards",
                node,
            )
        if collective_axis(node, ctx.mesh) == "ep":
            site = ctx.adapter.site(node.meta.get(REGION, ""))
            lookup = node.meta.get(TABLE, False)  # a split table's exchange (`tables`)
            if kind != "all_to_all" or (site.part != "moe" and not lookup):
                raise InternalError(f"an EP {kind} outside a MoE half or a table lookup", node)
            ep_by_region[node.meta[REGION]] += not lookup
    for info in ep_layers(ctx):
        expected_a2a = ALL_TO_ALLS[info.dispatch]
        if ep_by_region[info.region] != expected_a2a:
            raise InternalError(
                f"{info.region} has {ep_by_region[info.region]} EP all-to-alls, expected "
                f"{expected_a2a} ({info.dispatch} dispatch)"
            )


def _used(node: Node) -> bool:
    """A collective's result (after its wait) is read."""
    return any(u.target is not c10d.wait_tensor.default or u.users for u in node.users)


def _reduces_tokens(node: Node) -> bool:
    """An all-reduce of a value whose dim 0 is the token count (its partial's, before
    localization)."""
    source = as_node(node.args[0], "the value a collective moves")
    while source.meta.get(GLOBAL_VAL) is None and source.args and isinstance(source.args[0], Node):
        source = source.args[0]
    return _has_token_dim(source)


_HALVES = {"attention": "attention half", "moe": "MoE half", "layer": "between its halves"}


def _layouts(node: Node) -> bool:
    """Whether a collective is one the layout makes: a value moving into or out of an anchored
    module (the plan's anchors and exits: attention's entry gather, its exit), or a value the
    entry cut put on the token shard. An op's own exchange (a shift's rows, a statistic's sum)
    and a gather its rule asks for stay inside one module. A coalesced AllGather stands for
    entry gathers (`spmd.coalesce`), which the layout makes."""
    if COALESCED in node.meta:
        return True
    producer, consumers = collective_ends(node)
    if str(producer.meta.get(RULE, "")).startswith("entry cut"):
        return True
    regions = {producer.meta.get(REGION, "")} | {c.meta.get(REGION, "") for c in consumers}
    return len(regions) > 1


def _extra_collectives(gm: GraphModule, ctx: CompileContext) -> list[ExtraCollective]:
    """Each decoder layer's TP collectives beyond the layout's (`expected_collectives`; where
    the entry cut moved the gather, one AllGather per value it gathers, or fewer where
    `spmd.coalesce` merged them), in graph order: the collectives the layout makes
    (`_layouts`) are matched with its list first, kind by kind; the
    others, and any beyond the list, are extra."""
    promise = ctx.adapter.expected_collectives(ctx.options)
    cuts = {ctx.adapter.site(region).layer: cut for region, cut in entry_cuts(ctx).items()}
    remaining: dict[tuple[int, bool], list[str]] = {}
    extra = []
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is None or collective_axis(node, ctx.mesh) != "tp":
            continue
        site = ctx.adapter.site(node.meta.get(REGION, ""))
        if site.layer is None:
            continue
        in_moe = site.part == "moe"
        key = (site.layer, in_moe)
        if key not in remaining:
            expected = list(promise.tp_in_moe if in_moe else promise.tp_outside_moe)
            cut = cuts.get(site.layer)
            if not in_moe and cut is not None and cut.sharded and "all_gather" in expected:
                expected.remove("all_gather")  # the entry gathers the cut's values instead
                expected += ["all_gather"] * len(cut.gathered)
            remaining[key] = expected
        if kind in remaining[key] and _layouts(node):
            remaining[key].remove(kind)
            continue
        half = _HALVES.get(site.part, site.part)
        extra.append(
            ExtraCollective(
                site.layer, half, node.name, kind, node.meta.get(REASON, ""), source_line(node)
            )
        )
    return extra
