"""expert_parallel: a routed-experts op over expert-sharded weights becomes dispatch -> local
experts -> combine over the EP group (the whole world).

The ops are the model adapter's `routed_experts` (`core.adapter.RoutedExperts`, whose contract
this pass relies on: token rows, top-k expert ids with -1 for none, fp32 routing weights, then
the stacked expert weights and constants).

Requires: localize (the op's token tensors are this rank's token shard, `[Tl, ...]`; its expert
weights are this rank's E/ep experts). Ensures: no routed-experts node with expert-sharded
weights is left. In its place, on every rank (no `tp_rank`, no token owners: a rank routes the
rows it holds):

    dispatch  every valid (token, k) assignment goes to the rank holding its expert, with its
              token's row, its local expert index and its routing weight     all-to-all(ep)
    experts   the same op on the received rows and the local weights, one assignment per row
    combine   the weighted outputs go back to their source rank                all-to-all(ep)
    sum       each token's k outputs are added in fp32 at the source

plus one `[2, ep]` int64 output per MoE layer -- the assignments this rank sent to and received
from each rank -- appended to the graph's outputs and described by `EpLayers` (`moe.stats.ep_layers(ctx)`).

That is one row per (token, expert) assignment (`ep_rows="per_assignment"`). With
`ep_rows="per_rank"` a row is a (token, destination rank) pair: the
token's row goes once to each rank holding at least one of its experts, with its K routes (the
other ranks' set to -1), the expert rank's kernel sums its experts' weighted outputs in fp32,
one row comes back, and the source adds the ranks' sums in rank order (= expert order).
`"auto"` takes, per layer, the form with fewer bytes per token (`EpLayer.bytes_per_token`).

`ep_dispatch` chooses how the all-to-all is sized:
- "exact": exchange the per-destination counts (an all-to-all of ep integers), read them on the
  host, send exactly the valid assignments, in expert order (so a token's outputs are added in
  the single-device kernel's order). Padding rows (SP padding, `slots == -1`) have
  `topk_idx == -1`: no assignment, no row.
- "padded": no host read in the graph, no data-dependent size. Every rank sends every rank a
  buffer of C = Tl_max * min(K, E/ep) rows (Tl_max with one row per rank), the most one source
  can route to one destination (a token's K experts are distinct), so nothing is ever dropped; unused rows carry expert
  index -1 and cost bytes but no expert compute. Tl_max, the largest token-shard length over
  the EP group (DP groups serve different T), is the graph input `ep_tokens`: the runtime
  agrees on it with one all-reduce(max) of an integer before the call, outside the graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node, Proxy

from dsv41_compile.core.adapter import ActivationRows, RoutedExperts
from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.emitter import Emitter, cast
from dsv41_compile.core.errors import InternalError, as_node
from dsv41_compile.core.meta import (
    CAPTURE_FIX,
    EP_PADDED,
    EP_SOURCE,
    GLOBAL_VAL,
    IN,
    REASON,
    REGION,
    replace_node,
)
from dsv41_compile.core.packing import Column, pack, packed_dtype, packed_width, unpack
from dsv41_compile.core.placements import ExpertShard
from dsv41_compile.core.torch_private import OpOverload
from dsv41_compile.devices import timed_choice
from dsv41_compile.moe.stats import ALL_TO_ALLS, EP_ROWS, EpLayer, EpLayers
from dsv41_compile.options import LOWERINGS

__all__ = ["expert_parallel", "sharded_routed_experts"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def sharded_routed_experts(
    gm: GraphModule, ctx: CompileContext
) -> list[tuple[Node, RoutedExperts]]:
    """The routed-experts nodes whose expert weights are expert-sharded, with their spec."""
    found = []
    for node in gm.graph.nodes:
        spec = ctx.adapter.routed_experts_op(node.target)
        placements = node.meta.get(IN)
        if spec and placements and isinstance(placements[spec.weight_args()[0]], ExpertShard):
            found.append((node, spec))
    return found


def _dispatched(value: Proxy) -> Proxy:
    value.node.meta[EP_SOURCE] = True
    return value


def expert_parallel(gm: GraphModule, *, ctx: CompileContext) -> None:
    graph = gm.graph
    targets = sharded_routed_experts(gm, ctx)
    dispatch, why = _choose_dispatch(targets, ctx)
    padded = targets and dispatch == "padded"
    ep_tokens = ctx.ep_tokens_input(gm) if padded else None
    rewritten = [
        _rewrite(graph, node, spec, ctx, ep_tokens, _layer(node, spec, ctx, dispatch, why))
        for node, spec in targets
    ]
    stats = [node for node, _ in rewritten]
    ctx.put(EpLayers(tuple(info for _, info in rewritten)))
    if stats and dispatch == "exact":
        # The split sizes are read on the host: fake propagation (validate, inductor) must give
        # them unbacked symbols rather than refuse.
        ctx.fake_mode.allow_scalar_outputs = True
    if stats:
        output = graph.output_node()
        results = output.args[0]
        if not isinstance(results, (tuple, list)):
            raise InternalError(f"the graph returns {results}, not a tuple of its outputs")
        output.args = (tuple(results) + tuple(stats),)
    graph.lint()
    gm.recompile()


class _Emitter(Emitter):
    """An `Emitter` for the EP lowerings: `arange` on the activations' device, and the
    all-to-all over the EP group."""

    def __init__(self, graph: Graph, group: str, device: torch.device) -> None:
        super().__init__(graph)
        self.group, self.device = group, device

    def arange(self, end: Any) -> Proxy:
        return self.call(aten.arange.default, end, dtype=torch.int64, device=self.device)

    def a2a(self, value: Proxy, out_splits: list[Any], in_splits: list[Any]) -> Proxy:
        sent = c10d.all_to_all_single.default(value, out_splits, in_splits, self.group)
        return c10d.wait_tensor.default(sent)


@dataclass(frozen=True)
class _Routed:
    """The replaced op's arguments, as proxies: this rank's token shard and its experts."""

    op: OpOverload
    x: Proxy  # [Tl, D]
    topk_idx: Proxy  # [Tl, K] int64, -1: no assignment
    topk_weight: Proxy  # [Tl, K] fp32
    experts: tuple[Proxy, ...]  # this rank's E/ep experts of each stacked weight
    constants: tuple[Any, ...]
    dtype: torch.dtype  # of x, the activation dtype
    dim: int  # D
    rows: ActivationRows | None = None
    """The quantisation `x` comes from, when the op's input is the model's quantised
    activation: `x` is then its input, and the dispatch moves its quantised rows
    (`rows.encode`), which the receiver decodes to the op's input rows, bit for bit."""


def _codec(x: object, ctx: CompileContext) -> ActivationRows | None:
    """The model's activation quantisation where the op's input is its output (the dispatch
    then moves the encoded rows of the quantisation's input), else None."""
    codec = ctx.adapter.activation_rows
    if codec is None or not isinstance(x, Node) or x.op != "call_function":
        return None
    return codec if x.target == codec.quantize else None


def _layer(
    node: Node, spec: RoutedExperts, ctx: CompileContext, dispatch: str, why: str = ""
) -> EpLayer:
    """The layer's EP description with its row form chosen (`_choose_rows`) for `dispatch`;
    `why` (the dispatch's choice) leads its reason."""
    x, idx = node.args[:2]
    x_val = x.meta[GLOBAL_VAL]
    weight = node.args[spec.weight_args()[0]]
    codec = _codec(x, ctx)
    region = node.meta.get(REGION, "")
    info = _choose_rows(
        EpLayer(
            layer=ctx.adapter.site(region).layer,
            region=region,
            dispatch=dispatch,
            ep=ctx.mesh.ep,
            experts_per_rank=weight.meta[GLOBAL_VAL].shape[0] // ctx.mesh.ep,
            top_k=idx.meta[GLOBAL_VAL].shape[1],
            token_row_bytes=x_val.shape[1] * x_val.element_size(),
            dispatch_row_bytes=codec.width(x_val.shape[1]) if codec else None,
        ),
        ctx.options.ep_rows,
    )
    return dataclasses.replace(info, why=f"{why}; {info.why}") if why else info


def _choose_dispatch(
    targets: list[tuple[Node, RoutedExperts]], ctx: CompileContext
) -> tuple[str, str]:
    """The option's dispatch, or ("auto") padded for torchair (its graphs cannot read sizes on
    the host) and otherwise the one whose MoE layer is the shorter on the device model at
    `rows_per_step` rows (`ceil(rows / tp)` per rank), from the first layer's sizes (the
    layers share them): exact waits on 3 all-to-alls and on the host's read of the counts
    (taken as one more collective's latency: an assumption), and sends the rows expected
    under uniform routing; padded waits on 2 and sends its worst-case rows, plus one
    all-reduce of `Tl_max` per call (outside the graph), shared by the layers. Returns the
    dispatch and why (empty where the option named it)."""
    option = ctx.options.ep_dispatch
    if option != "auto" or not targets:
        return ("exact" if option == "auto" else option), ""
    if LOWERINGS[ctx.target].whole_graph is not None:  # a graph run on the device as a whole
        return "padded", f"ep_dispatch='auto': padded ({ctx.target} reads no size on the host)"
    node, spec = targets[0]
    device = ctx.options.device_model(node.args[0].meta[GLOBAL_VAL].device.type)
    rows = -(-ctx.options.rows_per_step // ctx.mesh.tp)
    latency = device.collective_latency
    seconds = {}
    for dispatch, waits in (("exact", ALL_TO_ALLS["exact"] + 1), ("padded", ALL_TO_ALLS["padded"])):
        info = _layer(node, spec, ctx, dispatch)
        seconds[dispatch] = device.collective_seconds(
            rows * info.bytes_per_token(), waits, group=ctx.mesh.ep, all_to_all=True
        )
    seconds["padded"] += latency / len(targets)
    chosen = min(seconds, key=seconds.__getitem__)
    why = timed_choice(
        "ep_dispatch", option, chosen, seconds, "layer", 1, device.name, ctx.options.rows_per_step
    )
    return chosen, f"{why} ({latency * 1e6:.0f} us per collective)"


def _rewrite(
    graph: Graph,
    node: Node,
    spec: RoutedExperts,
    ctx: CompileContext,
    ep_tokens: Node | None,
    info: EpLayer,
) -> tuple[Node, EpLayer]:
    x, idx, w = node.args[:3]
    weights = [node.args[i] for i in spec.weight_args()]
    constants = node.args[3 + spec.n_weights :]
    codec = _codec(x, ctx)
    x_val = x.meta[GLOBAL_VAL]
    emit = _Emitter(graph, ctx.mesh.ep_group_name, x_val.device)
    with emit.inserting_before(node) as added:
        p = emit.proxy
        routed = _Routed(
            spec.op, p(x.args[0] if codec else x), p(idx), p(w),
            tuple(p(v) for v in weights), tuple(constants), x_val.dtype, x_val.shape[1], codec,
        )  # fmt: skip
        lower = _LOWERINGS[info.dispatch, info.rows]
        if ep_tokens is None:
            out, stats = lower(emit, routed, info)
        else:
            out, stats = lower(emit, routed, info, p(ep_tokens))
    replace_node(node, out.node, added)
    for new in added:  # the choice, where graph.py shows the dispatch
        if new.name.startswith("ep_rows"):
            new.meta[REASON] = f"{new.meta[REASON]} ({info.why})"
    return stats.node, info


def _choose_rows(info: EpLayer, option: str) -> EpLayer:
    """`info` with its row form: the option's, or ("auto") the one whose dispatch + combine
    moves fewer bytes per token (`EpLayer.bytes_per_token`), with both figures in `why`."""
    forms = {rows: dataclasses.replace(info, rows=rows) for rows in EP_ROWS}
    cost = {rows: form.bytes_per_token() for rows, form in forms.items()}
    chosen = min(EP_ROWS, key=cost.__getitem__) if option == "auto" else option
    (other,) = set(EP_ROWS) - {chosen}
    expected = "expected" if info.dispatch == "exact" else "padded"
    why = (
        f"ep_rows={option!r}: {chosen}, {cost[chosen]:,.0f} B per token "
        f"({expected}, dispatch + combine) against {cost[other]:,.0f} B {other}"
    )
    return dataclasses.replace(forms[chosen], why=why)


def _exact(emit: _Emitter, op: _Routed, info: EpLayer) -> tuple[Proxy, Proxy]:
    ep, per_rank, K = info.ep, info.experts_per_rank, info.top_k
    expert = _dispatched(aten.view.default(op.topk_idx, [-1]))  # [A = Tl*K]
    # Expert order, unassigned last: their key E maps to destination ep, which is never sent.
    key = aten.where.ScalarOther(aten.ge.Scalar(expert, 0), expert, ep * per_rank)
    sorted_key, order = aten.sort.stable(key, stable=True)
    dest = emit.named(aten.floor_divide.default(sorted_key, per_rank), "ep_dest")
    to_rank = aten.eq.Tensor(aten.unsqueeze.default(dest, 1), emit.arange(ep))  # [A, ep]
    sent = emit.named(aten.sum.dim_IntList(to_rank, [0]), "ep_sent")
    received = emit.named(
        emit.a2a(sent, [1] * ep, [1] * ep),
        "ep_received",
        "EP count exchange: how many assignments each rank sends this rank",
    )
    send_splits, recv_splits, n_send = _exact_splits(emit, sent, received, ep)
    assignment = emit.named(aten.narrow.default(order, 0, 0, n_send), "ep_assignment")
    token = emit.named(aten.floor_divide.default(assignment, K), "ep_token")
    local = aten.remainder.Scalar(aten.narrow.default(sorted_key, 0, 0, n_send), per_rank)
    weight = aten.index_select.default(aten.view.default(op.topk_weight, [-1]), 0, assignment)
    route = aten.stack.default([aten._to_copy.default(local, dtype=torch.float32), weight], 1)
    x_send = _dispatched(aten.index_select.default(op.x, 0, token))
    y_back = _exchange(emit, op, x_send, route, send_splits, recv_splits, _EXACT_WHY)
    zeros = aten.zeros_like.default(op.x, dtype=torch.float32)
    out = aten.index_add.default(zeros, 0, token, cast(y_back, op.dtype, torch.float32))
    return emit.named(out, "ep_routed_out"), _stats(emit, sent, received)


def _padded(emit: _Emitter, op: _Routed, info: EpLayer, ep_tokens: Proxy) -> tuple[Proxy, Proxy]:
    ep, per_rank, K = info.ep, info.experts_per_rank, info.top_k
    # C rows per peer, the same on every rank
    capacity = ep_tokens * info.rows_per_token  # type: ignore[operator]  # fx.Proxy's operators are set at import (torch.fx.proxy)
    n_rows = capacity * ep
    expert = _dispatched(aten.view.default(op.topk_idx, [-1]))  # [A = Tl*K]
    assigned = aten.ge.Scalar(expert, 0)
    dest = emit.named(
        aten.floor_divide.default(aten.where.ScalarOther(assigned, expert, 0), per_rank),
        "ep_dest",
    )
    to_rank = aten.logical_and.default(
        aten.eq.Tensor(aten.unsqueeze.default(dest, 1), emit.arange(ep)),
        aten.unsqueeze.default(assigned, 1),
    )  # [A, ep]
    sent = emit.named(aten.sum.dim_IntList(to_rank, [0]), "ep_sent")
    # Each assignment's row in the send buffer: its destination's block, in (token, k) order;
    # unassigned entries go to a scratch row past the end, which is never sent.
    arrival = aten.gather.default(
        aten.cumsum.default(to_rank, 0), 1, aten.unsqueeze.default(dest, 1)
    )
    within = aten.sub.Tensor(aten.squeeze.dim(arrival, 1), 1)
    slot = emit.named(
        aten.where.ScalarOther(
            assigned, aten.add.Tensor(aten.mul.Tensor(dest, capacity), within), n_rows
        ),
        "ep_slot",
    )
    token = emit.named(
        aten.floor_divide.default(emit.arange(aten.sym_size.int(expert, 0)), K), "ep_token"
    )
    local = aten._to_copy.default(aten.remainder.Scalar(expert, per_rank), dtype=torch.float32)
    route = aten.stack.default([local, aten.view.default(op.topk_weight, [-1])], 1)
    out, routes = _padded_exchange(
        emit, op, slot, token, route, capacity, info.rows_per_token, ep, _PADDED_WHY
    )
    filled = aten.ge.Scalar(aten.select.int(routes, 1, 0), 0)
    received = aten.sum.dim_IntList(aten.view.default(filled, [ep, -1]), [1])
    return emit.named(out, "ep_routed_out"), _stats(emit, sent, received)


_EXACT_WHY = (
    "EP dispatch: each assignment's token row to the rank of its expert",
    "its local expert index and routing weight",
    "EP combine: weighted expert outputs back to their source rank",
)
_PADDED_WHY = (
    "EP dispatch (padded): C = Tl_max*min(K, E/ep) token rows to every rank",
    "its local expert index (-1: empty row) and routing weight",
    "EP combine (padded): expert outputs back to their source rank",
)


def _exchange(
    emit: _Emitter,
    op: _Routed,
    x_send: Proxy,
    route_send: Proxy,
    send_splits: list[Any],
    recv_splits: list[Any],
    why: tuple[str, str, str],
    with_routes: bool = False,
    k: int = 1,
    padded: int | None = None,
) -> Any:
    """Dispatch the token rows and routes, run the local experts, combine: the expert outputs
    of the sent rows, back in send order (and the received routes, if asked). A row and its
    routes move side by side in one all-to-all (`core.packing`: one latency, not two), as
    bytes where their dtypes differ. `padded`: the padded lowering's rows per peer per Tl_max,
    marked on both all-to-alls (`meta[EP_PADDED]`), which another exchange can then ride."""
    if op.rows is None:
        payload, column, what = x_send, Column(op.dtype, (op.dim,)), why[0]
    else:  # the quantised rows of the op's input, decoded to it
        payload = op.rows.encode(x_send)
        column = Column(torch.uint8, (op.rows.width(op.dim),))
        what = f"{why[0]}; {op.rows.name} rows of the quantisation's input"
    columns = [column, Column(torch.float32, (2 * k,))]
    sent = pack(_call, [payload, route_send], columns)
    moved = emit.named(
        emit.a2a(sent, recv_splits, send_splits), "ep_rows", f"{what}; with {why[1]}"
    )
    if padded is not None:
        _mark_padded(moved, ("dispatch", padded, packed_dtype(columns), packed_width(columns)))
    rows, routes = unpack(_call, moved, columns)
    if op.rows is not None:
        rows = op.rows.decode(rows)
    routes = emit.named(routes, "ep_routes")
    y = _local_experts(emit, op, rows, routes, k)
    y_back = emit.named(
        # the expert outputs in the activation dtype: exact for one route per row (computed in
        # it); per rank, each rank's fp32 partial sum is rounded once
        emit.a2a(cast(y, torch.float32, op.dtype), send_splits, recv_splits),
        "ep_combined",
        why[2],
    )
    if padded is not None:
        _mark_padded(y_back, ("combine", padded, op.dtype, op.dim))
    return (y_back, routes) if with_routes else y_back


def _mark_padded(wait: Proxy, mark: tuple[str, int, torch.dtype, int]) -> None:
    """`meta[EP_PADDED]` on the all-to-all `wait` waits on."""
    as_node(wait.node.args[0], "the all-to-all waited on").meta[EP_PADDED] = mark


def _call(target: Any, *args: Any) -> Any:
    """An op on proxies (`core.packing`'s emitters): traced into the graph."""
    return target(*args)


def _local_experts(emit: _Emitter, op: _Routed, rows: Proxy, routes: Proxy, k: int) -> Proxy:
    """The routed-experts op on the received rows, `k` routes per row (`[n, 2k]`: local expert
    indices, then routing weights), this rank's experts; a route with index -1 contributes
    nothing. Per row: the weighted sum of its routes' expert outputs, in fp32."""
    local = aten._to_copy.default(aten.slice.Tensor(routes, 1, 0, k), dtype=torch.int64)
    weight = aten.clone.default(
        aten.slice.Tensor(routes, 1, k, 2 * k), memory_format=torch.contiguous_format
    )  # the op's contract: routing tables as the gate made them, dense
    y = op.op(rows, local, weight, *op.experts, *op.constants)
    return emit.named(y, "ep_local_experts", "this rank's experts on the received rows")


def _stats(emit: _Emitter, *counts: Proxy) -> Proxy:
    return emit.named(
        aten.stack.default(list(counts)),
        "ep_stats",
        "EP statistics output: assignments sent to / received from each rank"
        + (", then rows" if len(counts) == 4 else ""),
    )


def _exact_per_rank(emit: _Emitter, op: _Routed, info: EpLayer) -> tuple[Proxy, Proxy]:
    """One row per (token, destination rank) that holds one of the token's experts, in
    (destination, token) order, carrying the token's K routes with the other ranks' set to
    -1; the expert rank returns one row, its experts' weighted sum."""
    ep, K = info.ep, info.top_k
    hit_RTK, local_TK, hit_RT, sent_rows, sent = _per_rank_routes(emit, op, info)
    received = emit.named(
        emit.a2a(aten.stack.default([sent_rows, sent], 1), [1] * ep, [1] * ep),
        "ep_received",
        "EP count exchange: how many rows (and assignments) each rank sends this rank",
    )  # [ep, 2]
    received_rows = aten.select.int(received, 1, 0)
    send_splits, recv_splits, n_send = _exact_splits(emit, sent_rows, received_rows, ep)
    flat = aten.view.default(hit_RT, [-1])  # (rank, token) pairs, rank-major
    miss = aten._to_copy.default(aten.logical_not.default(flat), dtype=torch.int64)
    _, order = aten.sort.stable(miss, stable=True)  # hits first, in (rank, token) order
    pair = emit.named(aten.narrow.default(order, 0, 0, n_send), "ep_pair")
    tl = aten.sym_size.int(op.x, 0)
    token = emit.named(aten.remainder.Scalar(pair, tl), "ep_token")
    routes_PK = aten.view.default(_route_table(op, hit_RTK, local_TK), [-1, 2 * K])
    route = aten.index_select.default(routes_PK, 0, pair)
    x_send = _dispatched(aten.index_select.default(op.x, 0, token))
    y_back = _exchange(emit, op, x_send, route, send_splits, recv_splits, _EXACT_PER_RANK_WHY,
                       k=K)  # fmt: skip
    zeros = aten.zeros_like.default(op.x, dtype=torch.float32)
    out = aten.index_add.default(zeros, 0, token, cast(y_back, op.dtype, torch.float32))
    received_assignments = aten.select.int(received, 1, 1)
    stats = _stats(emit, sent, received_assignments, sent_rows, aten.select.int(received, 1, 0))
    return emit.named(out, "ep_routed_out"), stats


def _padded_per_rank(
    emit: _Emitter, op: _Routed, info: EpLayer, ep_tokens: Proxy
) -> tuple[Proxy, Proxy]:
    """Every rank sends every rank a buffer of C = Tl_max rows: token t's row at t of the
    destination's block if the destination holds one of its experts, else an empty row
    (routes -1) that costs bytes but no expert compute."""
    ep, K = info.ep, info.top_k
    # = Tl_max
    capacity = ep_tokens * info.rows_per_token  # type: ignore[operator]  # fx.Proxy's operators are set at import (torch.fx.proxy)
    n_rows = capacity * ep
    hit_RTK, local_TK, hit_RT, sent_rows, sent = _per_rank_routes(emit, op, info)
    tl = aten.sym_size.int(op.x, 0)
    position = aten.add.Tensor(
        aten.unsqueeze.default(aten.mul.Tensor(emit.arange(ep), capacity), 1),
        aten.unsqueeze.default(emit.arange(tl), 0),
    )  # [ep, Tl]: row r*C + t
    slot = emit.named(
        aten.view.default(aten.where.ScalarOther(hit_RT, position, n_rows), [-1]), "ep_slot"
    )  # unhit pairs go to a scratch row past the end, which is never sent
    token = emit.named(aten.repeat.default(emit.arange(tl), [ep]), "ep_token")
    route = aten.view.default(_route_table(op, hit_RTK, local_TK), [-1, 2 * K])
    out, routes = _padded_exchange(
        emit,
        op,
        slot,
        token,
        route,
        capacity,
        info.rows_per_token,
        ep,
        _PADDED_PER_RANK_WHY,
        k=K,
    )
    routed = aten.ge.Scalar(aten.slice.Tensor(routes, 1, 0, K), 0)  # [n_rows, K]
    per_row = aten.sum.dim_IntList(aten.view.default(routed, [ep, -1, K]), [2])  # [ep, C]
    received = aten.sum.dim_IntList(per_row, [1])
    received_rows = aten.sum.dim_IntList(aten.gt.Scalar(per_row, 0), [1])
    stats = _stats(emit, sent, received, sent_rows, received_rows)
    return emit.named(out, "ep_routed_out"), stats


def _padded_exchange(
    emit: _Emitter,
    op: _Routed,
    slot: Proxy,
    token: Proxy,
    route: Proxy,
    capacity: Any,
    per_token: int,
    ep: int,
    why: tuple[str, str, str],
    k: int = 1,
) -> tuple[Proxy, Proxy]:
    """The padded lowering's exchange, for either kind of row: row i (token `token[i]`, routes
    `route[i]`) goes to buffer row `slot[i]` (`ep` blocks of `capacity`, `per_token` rows per
    Tl_max; the scratch row past the end is never sent; unfilled rows carry routes -1), the
    buffers are exchanged, each row's output comes back to its slot and is added, in fp32, to
    its token. Returns the fp32 `[Tl, D]` sum and the routes this rank received."""
    n_rows = capacity * ep
    x_buf = aten.index_put.default(
        aten.new_zeros.default(op.x, [n_rows + 1, op.dim]),
        [slot],
        _dispatched(aten.index_select.default(op.x, 0, token)),
    )
    width = 2 * k  # (local expert, weight) per route
    empty = emit.call(
        aten.full.default, [n_rows + 1, width], -1.0, dtype=torch.float32, device=emit.device
    )
    route_buf = aten.index_put.default(empty, [slot], route)
    splits = [capacity] * ep
    x_send = aten.split_with_sizes.default(x_buf, [n_rows, 1])[0]
    route_send = aten.split_with_sizes.default(route_buf, [n_rows, 1])[0]
    y_back, routes = _exchange(
        emit, op, x_send, route_send, splits, splits, why, True, k=k, padded=per_token
    )
    y_back = aten.cat.default([y_back, aten.new_zeros.default(y_back, [1, op.dim])])
    contributions = cast(aten.index_select.default(y_back, 0, slot), op.dtype, torch.float32)
    zeros = aten.zeros_like.default(op.x, dtype=torch.float32)
    return aten.index_add.default(zeros, 0, token, contributions), routes


def _per_rank_routes(emit: _Emitter, op: _Routed, info: EpLayer) -> tuple[Proxy, ...]:
    """`hit [ep, Tl, K]`: route k of token t goes to rank r; `local [Tl, K]`: its expert's
    index on that rank; `hit [ep, Tl]`: token t has a row for rank r; the rows and the
    assignments this rank sends each rank (`[ep]` each)."""
    per_rank = info.experts_per_rank
    assigned = _dispatched(aten.ge.Scalar(op.topk_idx, 0))
    dest = aten.where.ScalarOther(
        assigned, aten.floor_divide.default(op.topk_idx, per_rank), info.ep
    )  # [Tl, K]; ep: no assignment, matches no rank
    ranks = aten.view.default(emit.arange(info.ep), [info.ep, 1, 1])
    hit_RTK = emit.named(aten.eq.Tensor(aten.unsqueeze.default(dest, 0), ranks), "ep_hit")
    local_TK = aten.remainder.Scalar(op.topk_idx, per_rank)
    hit_RT = aten.gt.Scalar(aten.sum.dim_IntList(hit_RTK, [2]), 0)
    rows = emit.named(aten.sum.dim_IntList(hit_RT, [1]), "ep_sent")
    assignments = aten.sum.dim_IntList(hit_RTK, [1, 2])
    return hit_RTK, local_TK, hit_RT, rows, assignments


def _route_table(op: _Routed, hit_RTK: Proxy, local_TK: Proxy) -> Proxy:
    """`[ep, Tl, 2K]` fp32: for each (rank, token), the token's K local expert indices where
    the rank holds the expert (else -1), then their routing weights (else 0)."""
    local = aten.where.ScalarOther(hit_RTK, aten.unsqueeze.default(local_TK, 0), -1)
    weight = aten.where.ScalarOther(hit_RTK, aten.unsqueeze.default(op.topk_weight, 0), 0.0)
    local = aten._to_copy.default(local, dtype=torch.float32)
    return aten.cat.default([local, weight], 2)


def _exact_splits(
    emit: _Emitter, sent: Proxy, received: Proxy, ep: int
) -> tuple[list[Any], list[Any], Any]:
    """The exchanged per-peer counts read on the host: the send splits, the receive splits
    and the number of rows sent."""
    counts = aten.unbind.int(aten.cat.default([sent, received]))
    splits = [_host_count(emit, counts[i], i, ep) for i in range(2 * ep)]
    n_send = splits[0]
    for count in splits[1:ep]:
        n_send = n_send + count  # type: ignore[operator]  # fx.Proxy's operators are set at import (torch.fx.proxy)
    return splits[:ep], splits[ep:], n_send


def _host_count(emit: _Emitter, count: Proxy, i: int, ep: int) -> Proxy:
    name = f"ep_send_{i}" if i < ep else f"ep_recv_{i - ep}"
    value = emit.named(aten._local_scalar_dense.default(count), name)  # host read
    value.node.meta[CAPTURE_FIX] = (
        "ep_dispatch='padded' (the exact EP lowering reads each peer's row count on the host "
        "to size its all-to-all; the padded one sends Tl_max rows to every peer, static sizes)"
    )
    aten.sym_constrain_range_for_size.default(value)
    return value


_EXACT_PER_RANK_WHY = (
    "EP dispatch: each token's row once to each rank holding one of its experts",
    "the token's K routes on that rank (local expert index or -1, weight)",
    "EP combine: each row's weighted sum over the rank's experts back to its source rank",
)
_PADDED_PER_RANK_WHY = (
    "EP dispatch (padded, per rank): C = Tl_max token rows to every rank",
    "the token's K routes there (local index or -1, weight)",
    "EP combine (padded, per rank): each row's sum over the rank's experts back to its source",
)

_LOWERINGS: dict[tuple[str, str], Callable[..., tuple[Proxy, Proxy]]] = {
    ("exact", "per_assignment"): _exact,
    ("padded", "per_assignment"): _padded,
    ("exact", "per_rank"): _exact_per_rank,
    ("padded", "per_rank"): _padded_per_rank,
}
