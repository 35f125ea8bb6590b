"""What one rank moves and computes per call, read from its rewritten graph.

Every cost is a node of the per-rank graph:

- bytes: each collective's bytes sent and received by this rank (`report.comm.collective_bytes`:
  ring all-gather / reduce-scatter / all-reduce, pairwise all-to-all), from its local shapes;
- FLOPs: `2*M*N*K` per `mm` / `addmm`, `2*B*M*N*K` per `bmm` / `baddbmm`, and, per row handed
  to a routed-experts op and route, two FLOPs per element of one expert's weights (DeepSeek's
  SwiGLU expert: `6*D*I`; the kernel computes only valid routes, a static-shape kernel would
  compute every row it is given -- this counts the rows given; with one row per token and rank
  and exact sizes, a row's K routes count as the expected valid ones, K*Tl/ep per peer).
  Elementwise work is not counted.

Each cost belongs to one part of the model: `entry` (before layer 0: embedding, masks),
`attention` (a layer's attention half: its mHC pre, norm, attention, mHC post and the
collectives around them), `moe` (the MoE half: mHC pre, norm, gate, experts, dispatch / combine,
mHC post) or `exit` (final collapse, norm, head, output gather).

Sizes are formulas in T, the DP group's token count (sympy), for the rank with the fullest
token shard. Two kinds of size are not functions of T alone and are replaced, stated here:
`Tl_max` (the padded EP lowering's largest shard over the EP group) is ceil(T/tp), i.e. every
DP group serves T tokens; the exact EP lowering's data-dependent counts (`ep_send_j`,
`ep_recv_j`) take their expectation under uniform routing, per (source, destination) pair:
K*ceil(T/tp)/ep rows of one assignment each, or, with one row per (token, rank),
ceil(T/tp) * (1 - C(E - E/ep, K)/C(E, K)) rows (`moe.stats.EpLayer.expected_rows_per_peer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import sympy
import torch
from torch.fx import GraphModule, Node

from dsv41_compile.core.adapter import PARTS
from dsv41_compile.core.collectives import collective_kind
from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.meta import RIDING, TABLE, module_paths
from dsv41_compile.core.signature import ParamShard
from dsv41_compile.core.symbols import TL_MAX, T, graph_symbols
from dsv41_compile.core.torch_private import FloorDiv, sym_expr
from dsv41_compile.moe.stats import EpLayer, ep_layers
from dsv41_compile.report.comm import collective_bytes

__all__ = [
    "NPU_GROUPED_MATMUL",
    "NPU_QUANT_MATMUL",
    "NPU_SPARSE_FLASH_ATTENTION",
    "PARTS",
    "Cost",
    "RankInput",
    "assignment_flops",
    "ep_layer_of",
    "graph_costs",
    "in_t",
    "node_flops",
    "per_layer_formulas",
    "rank_inputs",
    "sizes_in_t",
    "summarize",
    "symbolic_size",
]

aten = torch.ops.aten
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


@dataclass(frozen=True)
class Cost:
    node: str
    part: str
    """One of PARTS."""
    layer: int | None
    kind: str
    """A collective kind ("all_gather", "reduce_scatter", "all_reduce", "all_to_all") or "matmul"."""
    axis: str | None
    """"tp" / "ep" for a collective."""
    bytes_sent: sympy.Expr
    bytes_received: sympy.Expr
    flops: sympy.Expr
    table: bool = False
    """A collective of a column-split table's exchange (`tables`: Engram's row ids and rows)."""
    riding: bool = False
    """The share of another collective's bytes that a table's exchange rides in (`tables`):
    bytes, but no collective of its own."""


@dataclass(frozen=True)
class RankInput:
    """A tensor input of a planned rank's program: a parameter (`param`, its fqn, and how the
    rank holds it, `shard`: None where whole) or a cache tensor (its `source` one the family's
    adapter calls a cache input, `ModelAdapter.is_cache`; dim 0 its slots), or another input."""

    node: Node
    value: torch.Tensor
    bytes: int | torch.SymInt  # an input sized by the step's tokens: symbolic
    param: str | None = None
    shard: ParamShard | None = None
    source: str = ""
    of_cache: bool = False
    """The family's adapter calls `source` a cache input."""

    @property
    def cache(self) -> bool:
        """A cache tensor, `[slots, ...]`: one slot per request and a scratch one."""
        return self.param is None and self.of_cache and self.value.dim() >= 2


def rank_inputs(gm: GraphModule, ctx: CompileContext) -> list[RankInput]:
    """The tensor inputs of the planned rank's program `gm`, with their local bytes (what the
    rank holds: tools/memory_plan.py, the step-time model's held weights)."""
    found = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for index, node in enumerate(placeholders):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):  # the rank, a token count
            continue
        size = value.numel() * value.element_size()
        param = ctx.param_fqns.get(node.name)
        shard = ctx.signature.param_shards.get(index) if param is not None else None
        source = ctx.input_sources.get(node.name, "")
        of_cache = ctx.adapter.is_cache(source)
        found.append(RankInput(node, value, size, param, shard, source, of_cache))
    return found


def graph_costs(gm: GraphModule, ctx: CompileContext) -> list[Cost]:
    """Every collective and matmul-like node of the rewritten graph `gm`, with its part, layer,
    bytes and FLOPs as formulas in T (see the module docstring for the substitutions)."""
    names = sizes_in_t(gm, ctx)
    costs = []
    moe_started: set[int] = set()
    seen_layer = False
    zero = sympy.Integer(0)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        # The part: the enclosing layer's half, in graph order (a layer's own nodes between its
        # halves -- the mHC collapse / expand -- belong to the MoE half once it has started).
        site = ctx.adapter.innermost_site(module_paths(node))
        here = site.layer
        if here is not None:
            seen_layer = True
            if site.part == "moe":
                moe_started.add(here)
            part = "moe" if here in moe_started else "attention"
        else:
            part = "exit" if seen_layer else "entry"
        kind = collective_kind(node)
        if kind is not None:
            axis, _, sent, received = collective_bytes(node, ctx)
            sent, received = (in_t(e, names, node) for e in (sent, received))
            flops = zero
        elif node.target in _MATMULS or ctx.adapter.routed_experts_op(node.target) is not None:
            axis, sent, received, kind = None, zero, zero, "matmul"
            flops = in_t(node_flops(node, ctx), names, node)
        else:
            continue
        table = kind != "matmul" and node.meta.get(TABLE, False)
        if RIDING in node.meta:  # a table's exchange in it: each its share of the bytes
            own, rider = node.meta[RIDING]
            mine, its = sympy.Rational(own, own + rider), sympy.Rational(rider, own + rider)
            costs.append(Cost(node.name, part, here, kind, axis, sent * mine, received * mine,
                              flops))  # fmt: skip
            costs.append(Cost(node.name, part, here, kind, axis, sent * its, received * its,
                              flops, table=True, riding=True))  # fmt: skip
            continue
        costs.append(Cost(node.name, part, here, kind, axis, sent, received, flops, table))
    return costs


def summarize(costs: list[Cost], tokens: int) -> dict[str, object]:
    """The costs at T = `tokens`: bytes sent / received and FLOPs per part, per decoder layer
    (averaged over the layers) and per collective kind and axis (per layer); and `tables`: the
    column-split tables' exchanges per layer that has one, next to that layer's other
    collectives."""
    layers = sorted({c.layer for c in costs if c.layer is not None})
    n_layers = max(len(layers), 1)

    def at(expr: sympy.Expr) -> int:
        return int(sympy.ceiling(expr.subs(T, tokens)))

    parts = {p: {"bytes_sent": 0, "bytes_received": 0, "flops": 0} for p in PARTS}
    collectives: dict[str, dict[str, int]] = {}
    for c in costs:
        sent, received, flops = at(c.bytes_sent), at(c.bytes_received), at(c.flops)
        entry = parts[c.part]
        entry["bytes_sent"] += sent
        entry["bytes_received"] += received
        entry["flops"] += flops
        if c.kind != "matmul" and c.layer is not None:
            key = f"{c.kind}({c.axis})"
            record = collectives.setdefault(key, {"count": 0, "bytes_sent": 0, "bytes_received": 0})
            record["count"] += not c.riding
            record["bytes_sent"] += sent
            record["bytes_received"] += received
    per_layer = {p: {k: v / n_layers for k, v in parts[p].items()} for p in ("attention", "moe")}
    # a table's exchange is in a decoder layer (Engram's): its layer is never None
    table_layers = sorted(cast(set[int], {c.layer for c in costs if c.table}))
    table_costs = [c for c in costs if c.table]
    return {
        "tokens_per_dp_group": tokens,
        "bytes_per_layer_per_rank": (
            per_layer["attention"]["bytes_sent"] + per_layer["moe"]["bytes_sent"]
        ),
        "flops_per_layer_per_rank": per_layer["attention"]["flops"] + per_layer["moe"]["flops"],
        "moe_flops_per_layer_per_rank": per_layer["moe"]["flops"],
        "attention_flops_per_layer_per_rank": per_layer["attention"]["flops"],
        "collectives": {
            k: {f: v / n_layers for f, v in record.items()}
            for k, record in sorted(collectives.items())
        },
        "parts": parts,
        "layers": n_layers,
        # per layer whose collectives move a column-split table's exchange: the first Engram
        # layer's, or the MoE layer's before it, in whose EP all-to-alls the exchange rides
        "tables": {
            "layers": table_layers,
            "bytes_sent_per_table_layer": (
                sum(at(c.bytes_sent) for c in table_costs) / max(len(table_layers), 1)
            ),
            "bytes_received_per_table_layer": (
                sum(at(c.bytes_received) for c in table_costs) / max(len(table_layers), 1)
            ),
            "other_bytes_sent_per_table_layer": (
                sum(
                    at(c.bytes_sent)
                    for c in costs
                    if c.layer in table_layers and c.kind != "matmul" and not c.table
                )
                / max(len(table_layers), 1)
            ),
        },
    }


def per_layer_formulas(costs: list[Cost]) -> dict[str, str]:
    """Bytes sent per decoder layer (averaged over the layers) by collective kind and axis, and
    FLOPs per layer of each half, as formulas in T."""
    layers = {c.layer for c in costs if c.layer is not None}
    n_layers = max(len(layers), 1)
    sums: dict[str, sympy.Expr] = {}
    for c in costs:
        if c.layer is None:
            continue
        key = f"{c.kind}({c.axis}) bytes" if c.kind != "matmul" else f"{c.part} flops"
        value = c.flops if c.kind == "matmul" else c.bytes_sent
        sums[key] = sums.get(key, sympy.Integer(0)) + value
    return {k: str(sympy.simplify(v / n_layers)) for k, v in sorted(sums.items())}


NPU_GROUPED_MATMUL = "npu.npu_grouped_matmul.default"
NPU_QUANT_MATMUL = "npu.npu_quant_matmul.default"
NPU_SPARSE_FLASH_ATTENTION = "npu.npu_sparse_flash_attention.default"
"""torch_npu's matmuls the NPU lowerings emit, by name (torch_npu registers them): the grouped
matmul of the routed experts (one output, `split_item=3`), the MXFP8 quantised matmul of the
FP8 linears and the sparse flash attention (its output first of three;
`deepseek_v41/graph_mode.py`)."""


def node_flops(node: Node, ctx: CompileContext) -> sympy.Expr:
    """The FLOPs of a matmul-like node (`mm`, `addmm`, `bmm`, `baddbmm`, a routed-experts op,
    torch_npu's grouped and quantised matmuls and its sparse flash attention), in the graph's own symbols (see the module
    docstring). A grouped matmul's rows are all its input's, each through one group."""
    val = node.meta["val"]
    shape = [symbolic_size(s) for s in (val[0] if isinstance(val, (list, tuple)) else val).shape]
    spec = ctx.adapter.routed_experts_op(node.target)
    if spec is not None:
        x, topk_idx = node.args[:2]
        rows = symbolic_size(x.meta["val"].shape[0])
        routes = symbolic_size(topk_idx.meta["val"].shape[1])
        info = ep_layer_of(node, ctx)
        if info is not None and info.rows == "per_rank" and info.dispatch == "exact":
            # a received row carries K routes, the valid ones are those of this rank: in
            # expectation K/ep assignments per token and peer over its expected rows
            expected = _rows_per_peer(info)
            routes = info.top_k / (info.ep * expected)
        return rows * routes * assignment_flops(node, ctx)
    if str(node.target) == NPU_GROUPED_MATMUL:  # x [R, K], weight [G, K, N] (FP4: [G, K/2, N])
        x, w = (cast(list, node.args[i])[0] for i in (0, 1))
        r, k = (symbolic_size(s) for s in x.meta["val"].shape)
        return 2 * r * k * symbolic_size(w.meta["val"].shape[2])
    if str(node.target) == NPU_SPARSE_FLASH_ATTENTION:  # q [B, S1, N1, D], index [.., K]
        # q k^T and p v of every query head over its whole index list (the kernel stops at
        # the first -1: an upper bound, the visible keys' count being data)
        keys = symbolic_size(node.args[3].meta["val"].shape[-1])
        return 4 * shape[0] * shape[1] * shape[2] * shape[3] * keys
    if str(node.target) == NPU_QUANT_MATMUL:  # x1 [M, K] @ x2 [K, N]
        k = symbolic_size(node.args[0].meta["val"].shape[1])
        return 2 * shape[0] * shape[1] * k
    if node.target in (aten.mm.default, aten.addmm.default):
        a = node.args[-2].meta["val"]
        return 2 * shape[0] * shape[1] * symbolic_size(a.shape[1])
    a = node.args[-2].meta["val"]  # bmm / baddbmm: [B, M, K] @ [B, K, N]
    return 2 * shape[0] * shape[1] * shape[2] * symbolic_size(a.shape[2])


def assignment_flops(node: Node, ctx: CompileContext) -> sympy.Expr:
    """The FLOPs of one (row, expert) assignment of a routed-experts op: its expert's matrices
    times one row, 2 FLOPs a multiply-add."""
    spec = ctx.adapter.routed_experts_op(node.target)
    if spec is None:
        raise InternalError("assignment_flops of a node that is no routed-experts op", node)
    return (
        2
        * spec.inputs_per_element
        * sum(
            sympy.Mul(*(symbolic_size(s) for s in node.args[i].meta["val"].shape[1:]))
            for i in spec.matrix_args()
        )
    )


def symbolic_size(s: object) -> sympy.Expr:
    """A size of a shape as a sympy expression (a symbolic size's expression)."""
    return sympy.sympify(sym_expr(s)) if isinstance(s, torch.SymInt) else sympy.Integer(s)


def sizes_in_t(gm: GraphModule, ctx: CompileContext) -> dict[object, sympy.Expr]:
    """The substitutions that make the sizes of `gm` formulas in T (the module docstring)."""
    tl = FloorDiv(T + ctx.mesh.tp - 1, ctx.mesh.tp)  # ceil(T/tp), printed as the graph does
    names = {k: (tl if v == TL_MAX else v) for k, v in graph_symbols(gm).items()}
    for node in gm.graph.nodes:
        if node.target is aten._local_scalar_dense.default:
            info = ep_layer_of(node, ctx)
            if info is None:
                raise InternalError("a host read outside an expert-parallel MoE", node)
            names[sym_expr(node.meta["val"])] = _rows_per_peer(info) * tl
    return names


def _rows_per_peer(info: EpLayer) -> sympy.Rational:
    """`EpLayer.expected_rows_per_peer` as a readable fraction: exact for tiny's 5/8, within
    1e-8 of flash's 1 - C(336, 6)/C(384, 6)."""
    expected = info.expected_rows_per_peer.limit_denominator(10_000)
    return sympy.Rational(expected.numerator, expected.denominator)


def ep_layer_of(node: Node, ctx: CompileContext) -> EpLayer | None:
    """The expert-parallel MoE layer `node` belongs to, if any."""
    paths = module_paths(node)
    return next((info for info in ep_layers(ctx) if info.region in paths), None)


def in_t(expr: sympy.Expr, names: dict[object, sympy.Expr], node: Node) -> sympy.Expr:
    """`expr`, a size of `node`, as a formula in T (`names`: `sizes_in_t`)."""
    out = sympy.sympify(expr).xreplace(names)
    if not out.free_symbols <= {T}:
        raise InternalError(f"size {expr} is not a function of T", node)
    return out
