"""insert: make every value arrive with the placement its consumer needs.

Requires: annotate (every node has `meta[IN]` / `meta[OUT]`).
Ensures: for every node, each tensor input's placement equals the one in `meta[IN]`; the
inserted nodes (collectives, pads, local slices) carry `meta[OUT]`, `meta[REASON]` and the
consumer's module and source line; one redistribution per (value, placement), shared by every
consumer after the first; a `tp_rank` placeholder and the token-size nodes exist. A value
redistributed because it leaves a module with an exit placement is redistributed in that module
(the inserted nodes carry the producer's module and source line).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.fx import GraphModule, Node

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.meta import GLOBAL_VAL, IN, OUT, REGION, RULE
from dsv41_compile.core.placements import format_placement
from dsv41_compile.core.symbols import is_token_count
from dsv41_compile.spmd.annotate import exit_placement, partial_goes_to
from dsv41_compile.spmd.transitions import TokenSizes, pad_value, redistribute

__all__ = ["insert_collectives"]


def insert_collectives(gm: GraphModule, *, ctx: CompileContext) -> None:
    graph = gm.graph
    token_input = next(n for n in graph.nodes if n.name == ctx.token_input)
    sizes = TokenSizes.create(graph, token_input, ctx.mesh.tp, ctx.mesh.tp_group_name)
    ctx.put(sizes)
    done: dict[tuple[Node, Placement, int], Node] = {}
    for node in list(graph.nodes):
        needed: tuple[Placement, ...] | None = node.meta.get(IN)
        if not needed:
            continue
        placements = iter(enumerate(needed))

        def fix(arg: Node, consumer: Node = node, placements=placements) -> Node:
            if not isinstance(arg, Node) or not isinstance(arg.meta.get(GLOBAL_VAL), torch.Tensor):
                return arg
            position, dst = next(placements)
            src = arg.meta[OUT]
            if src == dst:
                return arg
            fill = pad_value(consumer, position, ctx.adapter)
            first = _partial_first_to(arg, src, dst, ctx)
            if first is not None:  # the partial reaches the plan's placement first
                arg = placed(arg, consumer, first, fill)
            return placed(arg, consumer, dst, fill)

        def placed(arg: Node, consumer: Node, dst: Placement, fill: int) -> Node:
            """`arg` redistributed to `dst` before `consumer` (once per value and placement)."""
            src = arg.meta[OUT]
            key = (arg, dst, fill)
            if key not in done:
                why = _why(arg, consumer, dst)
                site = arg if exit_placement(arg, consumer, ctx) == dst else consumer
                with graph.inserting_before(consumer):
                    out = redistribute(
                        graph, arg, src, dst, sizes,
                        site=site, why=why, fill=fill, choice=_choice(arg, consumer, dst, ctx),
                    )  # fmt: skip
                out.meta[OUT] = dst
                out.meta[GLOBAL_VAL] = arg.meta[GLOBAL_VAL]  # same global value, new placement
                done[key] = out
            return done[key]

        node.args = torch.fx.node.map_arg(node.args, fix)
        node.kwargs = torch.fx.node.map_arg(node.kwargs, fix)
    gm.graph.lint()
    gm.recompile()


def _partial_first_to(
    value: Node, src: Placement, dst: Placement, ctx: CompileContext
) -> Placement | None:
    """Where a partial sum must pass on its way to `dst` (`annotate.partial_goes_to`: a
    row-parallel head's logits in `sp` are reduce-scattered to token shards, then gathered,
    where an all-reduce would break the layout), else None."""
    if not (isinstance(src, Partial) and src.reduce_op == "sum"):
        return None
    to = partial_goes_to(value, ctx)
    return None if dst == to or isinstance(to, Replicate) else to


def _choice(value: Node, consumer: Node, dst: Placement, ctx: CompileContext) -> str | None:
    """The decision (`ctx.choices`: the adapter's attention exit, the entry cut) behind a
    transition into `consumer`'s region: the layout's gathers of token shards and its
    reductions or all-to-alls into them. Not a gather an op's own rule asks for (a shift, a
    statistic over the tokens, an op along the heads), which its reason explains."""
    if str(consumer.meta.get(RULE, "")).startswith("tokens gathered"):
        return None
    src = value.meta[OUT]
    tokens = is_token_count(_global_shape(value)[0]) if _global_shape(value) else False
    gathered = src == Shard(0) and isinstance(dst, Replicate)
    scattered = dst == Shard(0) and (isinstance(src, Partial) or src == Shard(1))
    if not tokens or not (gathered or scattered):
        return None
    return ctx.choice_for((consumer.meta.get(REGION, ""),))


def _global_shape(value: Node) -> tuple:
    val = value.meta.get(GLOBAL_VAL)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def _why(value: Node, consumer: Node, dst: Placement) -> str:
    region = consumer.meta.get(REGION) or "the graph output"
    rule = consumer.meta.get(RULE, "")
    if rule.startswith("replicated") or rule.startswith("graph outputs"):
        rule = ""
    return f"{consumer.name} in {region} needs {value.name} as {format_placement(dst)}" + (
        f" ({rule})" if rule else ""
    )
