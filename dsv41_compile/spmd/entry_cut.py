"""entry_cut: gather what a region's per-token ops make of its input, when that is narrower.

Requires: annotate. Ensures: in every region the plan lets cut (`ShardingPlan.entry_cuts`), the
ops on the input's side of the cheapest cut run on token shards (their `meta[IN]`, `meta[OUT]`
and `meta[RULE]` rewritten), so that insert gathers the values crossing the cut where it
gathered the region's input; every other node keeps its placements. The cut of each region is
in `EntryCuts` (`entry_cuts(ctx)`) and its reason in `ctx.choices`, which insert appends to its AllGathers.

A region with a Replicate anchor (sp's attention) receives its token-sharded input x gathered:
every op in it runs on all T rows. Some of those ops act row by row with replicated weights
(V4.1: `wq_a` -> `q_norm`, `wkv` -> `kv_norm` -> rope, the compressor's projections, the
indexer's `weights_proj`), and what they make is narrower than x. They could run on the Tl rows
of the shard, and their outputs be gathered instead (what serving stacks write by hand as
"gather the latents"). Which of them is worth it is a minimum cut:

- the per-token subgraph: the region's ops that depend on x and whose rule maps token shards to
  token shards with every other input as annotate placed it (a replicated weight; a value of the
  token inputs, sliced locally, which costs nothing), and whose inputs from x are per-token too;
- gathering a value costs `(tp-1)/tp * T * row bytes` (a ring AllGather, as `report.comm`
  counts it): the common factor drops out, each value costs its row's bytes, once however many
  ops read it;
- an op that needs a per-token value replicated (a head-sharded projection, the cache writes,
  attention over the batch's rows) needs it gathered.

The source side of the minimum cut (networkx, as AOTAutograd's partitioner) runs on token
shards; ties go to fewer collectives, then to fewer ops moved. With x's own row the cheapest,
nothing moves: the region gathers x as before.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import networkx as nx
import torch
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.meta import IN, OUT, REGION, RULE, module_paths, tensor_inputs
from dsv41_compile.core.plan import pattern_matches
from dsv41_compile.spmd.rules import rule_answers, strategy_for, tensor_outputs

__all__ = ["EntryCut", "EntryCuts", "entry_cut", "entry_cuts"]

_TOKENS = Shard(0)


@dataclass(frozen=True)
class EntryCut:
    """One region's cut: the values gathered (in graph order) with their row bytes, the ops
    moved to token shards, and the row bytes of gathering the region's input instead."""

    region: str
    gathered: tuple[Node, ...]
    row_bytes: tuple[int, ...]
    sharded: frozenset[Node]
    input_row_bytes: int
    alternative_row_bytes: int | None = None
    """Where the input is gathered: the row bytes of the cheapest cut that moves ops (None if
    an op needs the input itself)."""

    @property
    def total(self) -> int:
        return sum(self.row_bytes)

    def why(self, option: str) -> str:
        if not self.sharded:
            why = f"{option}: the input, {self.input_row_bytes:,} B per token row"
            if self.alternative_row_bytes is None:
                return f"{why} (an op needs it whole)"
            return f"{why}, against {self.alternative_row_bytes:,} B for the cheapest cut"
        parts = " + ".join(
            f"{_label(n, self.region)} {b:,}" for n, b in zip(self.gathered, self.row_bytes)
        )
        return (
            f"{option}: {len(self.sharded)} per-token ops on the token shard, gathered {parts} "
            f"= {self.total:,} B per token row against {self.input_row_bytes:,} B for the input"
        )


@dataclass(frozen=True)
class EntryCuts:
    """What the pass kept for a compile: region -> the cut its entry AllGathers moved to."""

    regions: Mapping[str, EntryCut]


def entry_cuts(ctx: CompileContext) -> Mapping[str, EntryCut]:
    """The regions the pass cut in this compile (none when it did not run)."""
    return ctx.get(EntryCuts, EntryCuts({})).regions


def _label(node: Node, region: str) -> str:
    """What made `node`: its module relative to `region` (`q_norm`, `indexer.weights_proj`), or
    its op where the region's own code made it (`cat`). The graph's AllGathers name the node."""
    paths = module_paths(node)
    inner = paths[-1].removeprefix(region).lstrip(".") if paths else ""
    return inner or getattr(node.target, "_opname", str(node.target))


def entry_cut(gm: GraphModule, *, ctx: CompileContext) -> None:
    patterns = ctx.plan.entry_cuts
    if not patterns or ctx.mesh.tp == 1:
        return
    token_count = next(n for n in gm.graph.nodes if n.name == ctx.token_input).meta["val"].shape[0]
    regions: dict[str, list[Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        region = node.meta.get(REGION, "")
        if node.op == "call_function" and any(pattern_matches(p, region) for p in patterns):
            regions[region].append(node)
    token_inputs = [
        n for n in gm.graph.nodes
        if n.op == "placeholder" and ctx.input_sources.get(n.name) in ctx.adapter.token_inputs
    ]  # fmt: skip
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    cuts = {}
    for region, nodes in regions.items():
        cut = _cut(region, nodes, ctx, token_count, token_inputs, order)
        if cut is None:
            continue
        cuts[region] = cut
        ctx.choices[region] = cut.why(ctx.plan.entry_cut_reason)
    ctx.put(EntryCuts(cuts))


def _row_bytes(node: Node) -> int | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return None
    row = 1
    for size in val.shape[1:]:
        if not isinstance(size, int):
            return None
        row *= size
    return row * val.element_size()


def _sources(region: str, nodes: list[Node]) -> list[Node]:
    """The token-sharded values that enter `region` gathered (annotate's anchor)."""
    sources: dict[Node, None] = {}
    for node in nodes:
        for producer, needed in zip(tensor_inputs(node), node.meta.get(IN, ())):
            entering = region not in module_paths(producer)
            if entering and producer.meta.get(OUT) == _TOKENS and needed == Replicate():
                sources[producer] = None
    return list(sources)


def _per_token(
    node: Node,
    aligned: dict[Node, bool],
    ctx: CompileContext,
    token_count: object,
) -> tuple[tuple[Placement, ...], tuple[Placement | None, ...], str] | None:
    """The strategy under which `node` runs on token shards: its token-aligned inputs sharded,
    every other input as annotate placed it; None if its rule redistributes anything or its
    output is not token-aligned."""
    inputs = tensor_inputs(node)
    given = tuple(_TOKENS if p in aligned else need for p, need in zip(inputs, node.meta[IN]))
    try:
        strategy, source = strategy_for(
            node, given, ctx.mesh.tp_mesh, ctx.adapter.rules, rule_answers(ctx)
        )
    except (NotImplementedError, ValueError, RuntimeError, AssertionError):
        return None  # no rule takes this op's inputs token-sharded (DTensor's rules assert)
    if tuple(strategy.inputs) != given:
        return None
    for out, v in tensor_outputs(node, strategy):
        if out != _TOKENS or v.dim() == 0 or not statically_known_true(v.shape[0] == token_count):
            return None
    return strategy.inputs, strategy.outputs, f"entry cut: {source} {strategy}"


def _cut(
    region: str,
    nodes: list[Node],
    ctx: CompileContext,
    token_count: object,
    token_inputs: list[Node],
    order: dict[Node, int],
) -> EntryCut | None:
    sources = _sources(region, nodes)
    if not sources or any(_row_bytes(s) is None for s in sources):
        return None
    # Token-aligned values: the sources, the token inputs, and region ops that map them row by
    # row. The candidates to move are those that depend on a source.
    aligned: dict[Node, bool] = {s: True for s in sources}  # value -> depends on a source
    aligned.update((n, False) for n in token_inputs)
    moved: dict[Node, tuple] = {}
    for node in nodes:
        inputs = tensor_inputs(node)
        if not any(p in aligned for p in inputs):
            continue
        if node.target is operator.getitem:
            source = node.args[0]
            if source in moved:
                aligned[node] = True
            continue
        strategy = _per_token(node, aligned, ctx, token_count)
        if strategy is None:
            continue
        aligned[node] = any(aligned[p] for p in inputs if p in aligned)
        if aligned[node]:
            moved[node] = strategy
    candidates = [n for n in aligned if aligned[n]]
    if not any(n not in sources for n in candidates):
        return None

    network = _network(sources, candidates, aligned)
    _, (side, _) = nx.minimum_cut(network, "s", "t")
    sharded = frozenset(n for n in candidates if ("v", n) in side and n not in sources)
    gathered = tuple(
        sorted(
            (n for n in candidates if ("v", n) in side and ("g", n) not in side),
            key=order.__getitem__,
        )
    )
    for node in sorted(sharded, key=order.__getitem__):
        if node.target is operator.getitem:
            node.meta[OUT] = node.args[0].meta[OUT][node.args[1]]
            continue
        ins, outs, rule = moved[node]
        node.meta[IN] = ins
        node.meta[OUT] = outs if isinstance(node.meta.get("val"), (tuple, list)) else outs[0]
        node.meta[RULE] = rule
    sizes = [_row_bytes(n) for n in gathered]
    rows = tuple(r for r in sizes if r is not None)
    if len(rows) != len(sizes):
        raise InternalError(f"{region}: the cut gathers a value without a row size")
    alternative = None
    if not sharded:  # the input won: what the cheapest cut that moves the ops would gather
        try:
            value = nx.maximum_flow_value(_network(sources, candidates, aligned, False), "s", "t")
            alternative = int(value) // (len(candidates) + 1)
        except nx.NetworkXUnbounded:
            pass  # some op needs the input itself replicated
    return EntryCut(
        region=region,
        gathered=gathered,
        row_bytes=rows,
        sharded=sharded,
        input_row_bytes=sum(_row_bytes(s) or 0 for s in sources),
        alternative_row_bytes=alternative,
    )


def _network(
    sources: list[Node], candidates: list[Node], aligned: dict[Node, bool], gather_sources=True
) -> nx.DiGraph:
    """The flow network of a region's cut. v(n) on the source side: n runs on token shards;
    the edge v(n) -> g(n) is cut when n is gathered, at its row bytes scaled so that one more
    collective breaks a tie (a tuple or 0-d value, and the sources when `gather_sources` is
    False, are never gathered)."""
    scale = len(candidates) + 1
    graph = nx.DiGraph()
    graph.add_node("t")
    for s in sources:
        graph.add_edge("s", ("v", s))
    for n in candidates:
        row = _row_bytes(n)
        if row is None or (n in sources and not gather_sources):
            graph.add_edge(("v", n), ("g", n))  # no capacity: never cut
        else:
            graph.add_edge(("v", n), ("g", n), capacity=row * scale + 1)
        for user in n.users:
            if aligned.get(user):
                graph.add_edge(("g", n), ("v", user))
                graph.add_edge(("v", user), ("v", n))  # a moved op's inputs are moved too
                continue
            needs = {need for p, need in zip(tensor_inputs(user), user.meta.get(IN, ())) if p is n}
            needs = needs or {Replicate()}  # a user annotate gave no input placements
            if needs <= {_TOKENS}:
                continue  # the user takes a token shard (a local slice of the replicated value)
            if needs <= {_TOKENS, Replicate()}:
                graph.add_edge(("g", n), "t")  # the user needs n gathered
            else:
                graph.add_edge(("v", n), "t")  # no transition from a token shard: never move n
    return graph
