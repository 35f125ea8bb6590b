"""validate: re-run fake propagation on the per-rank graph and check what the layout promises.

Requires: localize. Ensures: every node's value (`meta["val"]`) is the local one, computed by
fake-tensor propagation from local inputs; each annotated node's local shape is its global
shape with sharded dims divided over tp (expert dims over ep); the graph lints; the layout invariants hold; and
`ctx.comm` holds one record per collective (DESIGN §5).

Layout invariants of `layout="sp"` (DESIGN §2): per decoder layer exactly one AllGather(tp),
whose input is the 2-D `[Tl, D]` attention input (not the `[Tl, n, D]` residual), and exactly one
ReduceScatter(tp), whose input is fp32; no TP collective in the MoE half; no all-reduce.
Of `layout="replicated"` (DESIGN §6): per decoder layer exactly one all-reduce(tp) of fp32 and,
in the MoE half, one AllGather(tp) with ep > 1 (its output shared back), none with ep = 1.
Both: EP all-to-alls only in the MoE half (with ep > 1: 4 per MoE layer with exact dispatch, 3
padded).
"""

from __future__ import annotations

import math
import re
from typing import Any

import sympy
import torch
from torch.distributed.tensor import Shard
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dsv41_compile.collectives.expert_parallel import EP_TOKENS
from dsv41_compile.context import CompileContext
from dsv41_compile.fx_utils import GLOBAL_VAL, OUT, REASON, REGION, describe, hint_shape
from dsv41_compile.propagation.plan import ExpertShard

__all__ = [
    "COLLECTIVES",
    "collective_bytes",
    "collective_kind",
    "comm_records",
    "graph_symbols",
    "local_inputs",
    "validate",
]

c10d = torch.ops._c10d_functional
COLLECTIVES = {
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_reduce.default: "all_reduce",
    c10d.all_to_all_single.default: "all_to_all",
}
_LAYER = re.compile(r"^layers\.(\d+)(\.|$)")


def collective_kind(node: Node) -> str | None:
    return COLLECTIVES.get(node.target) if node.op == "call_function" else None


def local_inputs(gm: GraphModule, ctx: CompileContext) -> list[Any]:
    """Fake values of the per-rank graph's inputs: local parameter shards, `tp_rank`, and the
    (unchanged) model inputs."""
    inputs = []
    for index, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        if node.name == "tp_rank":
            with ctx.fake_mode:
                inputs.append(torch.zeros((), dtype=torch.int64))
            continue
        if node.name == EP_TOKENS:
            inputs.append(node.meta["val"])
            continue
        val = node.meta.get(GLOBAL_VAL, node.meta.get("val"))
        if index in ctx.param_shards:
            shape = ctx.param_shards[index].local_shape(list(val.shape))
            with ctx.fake_mode:
                val = torch.empty(shape, dtype=val.dtype, device=val.device)
        inputs.append(val)
    return inputs


def validate(gm: GraphModule, *, ctx: CompileContext) -> bool:
    gm.graph.lint()
    FakeTensorProp(gm, mode=ctx.fake_mode).propagate_dont_convert_inputs(*local_inputs(gm, ctx))
    _check_local_shapes(gm, ctx)
    ctx.comm[:] = comm_records(gm, ctx)
    _check_layout(gm, ctx)
    return True


def _token_hints(ctx: CompileContext) -> tuple[object, int, int]:
    T = ctx.sizes.T.meta["val"]
    t_hint = optimization_hint(T)
    tp = ctx.mesh.tp
    symbol = T.node.expr if isinstance(T, torch.SymInt) else None
    return symbol, t_hint, math.ceil(t_hint / tp) * tp


def _as_symint(expr: object, like: torch.SymInt) -> object:
    expr = sympy.sympify(expr)
    if expr.is_Integer:
        return int(expr)
    return like.node.shape_env.create_symintnode(expr, hint=None)


def _check_local_shapes(gm: GraphModule, ctx: CompileContext) -> None:
    symbol, t_hint, tpad_hint = _token_hints(ctx)
    tp = ctx.mesh.tp
    for node in gm.graph.nodes:
        global_val, placement = node.meta.get(GLOBAL_VAL), node.meta.get(OUT)
        val = node.meta.get("val")
        if not isinstance(global_val, torch.Tensor) or not isinstance(val, torch.Tensor):
            continue
        expected = list(hint_shape(global_val))
        if isinstance(placement, ExpertShard):
            expected[placement.dim] //= ctx.mesh.ep
        elif isinstance(placement, Shard):
            size = global_val.shape[placement.dim]
            if isinstance(size, torch.SymInt) and symbol is not None:
                padded = sympy.sympify(size.node.expr).xreplace({symbol: sympy.Integer(tpad_hint)})
                padded = int(optimization_hint(_as_symint(padded, size)))
            elif symbol is None and placement.dim == 0 and t_hint % tp:
                continue  # a static, uneven token count: padded sizes are not in the graph
            else:
                padded = int(size)
            if padded % tp:
                raise AssertionError(f"{describe(node)}: padded size {padded} not divisible by tp")
            expected[placement.dim] = padded // tp
        actual = list(hint_shape(val))
        if actual != expected:
            raise AssertionError(
                f"{describe(node)} placed {placement}: local shape {actual}, expected {expected}"
            )


def _fmt_size(size: object, symbol: object) -> str:
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        if symbol is not None:
            expr = expr.xreplace({symbol: sympy.Symbol("T", positive=True, integer=True)})
        return str(expr)
    return str(size)


_T = sympy.Symbol("T", positive=True, integer=True)
_TL_MAX = sympy.Symbol("Tl_max", positive=True, integer=True)
EXAMPLE_TOKEN_COUNTS = (1, 8, 2048)


def graph_symbols(gm: GraphModule, ctx: CompileContext) -> dict[object, sympy.Symbol]:
    """The graph's symbols that have a name: T (the DP group's token count) and Tl_max (the
    padded EP lowering's `ep_tokens` input)."""
    symbol = _token_hints(ctx)[0]
    names: dict[object, sympy.Symbol] = {symbol: _T} if symbol is not None else {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name == EP_TOKENS:
            names[node.meta["val"].node.expr] = _TL_MAX
    return names


def _numel(val: torch.Tensor) -> sympy.Expr:
    return sympy.Mul(*(_sym_expr(s) for s in val.shape))


def _axis(node: Node, ctx: CompileContext) -> str:
    group = node.args[-1]
    if group == ctx.mesh.tp_group_name:
        return "tp"
    if group == ctx.mesh.ep_group_name:
        return "ep"
    raise AssertionError(f"{describe(node)} runs on an unknown process group {group!r}")


def _sym_expr(size: object) -> sympy.Expr:
    val = size.meta["val"] if isinstance(size, Node) else size
    return sympy.sympify(val.node.expr) if isinstance(val, torch.SymInt) else sympy.Integer(val)


def _a2a_bytes(splits: list[object], val: torch.Tensor, rank: int) -> sympy.Expr:
    """Bytes of the chunks for the other ranks (the chunk at `rank` stays)."""
    exprs = [_sym_expr(s) for s in splits]
    row = val.element_size() * math.prod(int(d) for d in val.shape[1:])
    return (sum(exprs, sympy.Integer(0)) - exprs[rank]) * row


def collective_bytes(node: Node, ctx: CompileContext) -> tuple[str, int, sympy.Expr, sympy.Expr]:
    """(axis, group size, bytes this rank sends, bytes it receives) of a collective node, in the
    graph's own symbols (data-dependent all-to-all splits stay unbacked symbols). Algorithms:
    ring all-gather / reduce-scatter ((tp-1) chunks of the shard each way), ring all-reduce (a
    reduce-scatter then an all-gather: 2(tp-1)/tp of the buffer each way), pairwise all-to-all
    (every chunk but the rank's own)."""
    kind, axis = collective_kind(node), _axis(node, ctx)
    inp, out = node.args[0].meta["val"], node.meta["val"]
    tp = ctx.mesh.tp
    if kind == "all_to_all":
        rank = ctx.mesh.rank
        group_size = ctx.mesh.ep if axis == "ep" else tp
        return (
            axis,
            group_size,
            _a2a_bytes(node.args[2], inp, rank),
            _a2a_bytes(node.args[1], out, rank),
        )
    if kind == "all_reduce":
        moved = sympy.Rational(2 * (tp - 1), tp) * _numel(inp) * inp.element_size()
    else:
        shard = inp if kind == "all_gather" else out
        moved = (tp - 1) * _numel(shard) * shard.element_size()
    return axis, tp, moved, moved


def comm_records(gm: GraphModule, ctx: CompileContext) -> list[dict[str, Any]]:
    """One record per collective: kind, axis, group size, dtype, local shapes, bytes this rank
    sends and receives (`collective_bytes`) as a formula in T and at a few token counts, layer,
    reason. A padded EP all-to-all's formula is in Tl_max (the largest token shard over the EP
    group; its values at T assume every DP group serves T tokens); an exact one's sizes are
    data-dependent ("data-dependent": `comm.json`'s `ep_steps` has each call's bytes)."""
    symbol = _token_hints(ctx)[0]
    tp = ctx.mesh.tp
    names = graph_symbols(gm, ctx)
    records = []
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        axis, group_size, sent, received = collective_bytes(node, ctx)
        sent, received = (_named(e, names) for e in (sent, received))
        inp, out = node.args[0].meta["val"], node.meta["val"]
        match = _LAYER.match(node.meta.get(REGION, ""))
        records.append(
            {
                "node": node.name,
                "kind": kind,
                "axis": axis,
                "group_size": group_size,
                "dtype": str(inp.dtype).removeprefix("torch."),
                "input_shape": [_fmt_size(s, symbol) for s in inp.shape],
                "output_shape": [_fmt_size(s, symbol) for s in out.shape],
                "bytes_sent": _fmt_bytes(sent),
                "bytes_received": _fmt_bytes(received),
                "bytes_sent_at": _bytes_at(sent, tp),
                "bytes_received_at": _bytes_at(received, tp),
                "layer": int(match.group(1)) if match else None,
                "region": node.meta.get(REGION, ""),
                "reason": node.meta.get(REASON, ""),
            }
        )
    return records


def _named(expr: sympy.Expr, names: dict[object, sympy.Symbol]) -> sympy.Expr | None:
    """`expr` in T / Tl_max, or None when it depends on data (unbacked sizes)."""
    expr = expr.xreplace(names)
    return expr if expr.free_symbols <= {_T, _TL_MAX} else None


def _fmt_bytes(expr: sympy.Expr | None) -> str:
    return "data-dependent" if expr is None else str(expr)


def _bytes_at(expr: sympy.Expr | None, tp: int) -> dict[str, int] | None:
    """`expr` at a few T, every DP group serving T tokens (so Tl_max = ceil(T/tp))."""
    if expr is None:
        return None
    return {
        f"T={t}": int(expr.xreplace({_T: t, _TL_MAX: -(-t // tp)})) for t in EXAMPLE_TOKEN_COUNTS
    }


def _check_layout(gm: GraphModule, ctx: CompileContext) -> None:
    layout, ep = ctx.options.layout, ctx.mesh.ep
    # The TP collectives of each decoder layer, outside / inside its MoE half.
    if layout == "sp":
        expected_tp, expected_moe = ["all_gather", "reduce_scatter"], []
    else:
        expected_tp, expected_moe = ["all_reduce"], ["all_gather"] if ep > 1 else []
    layers = sorted({int(m.group(1)) for f in ctx.param_fqns.values() if (m := _LAYER.match(f))})
    per_layer: dict[int, list[Node]] = {i: [] for i in layers}
    per_moe: dict[int, list[Node]] = {i: [] for i in layers}
    ep_per_region: dict[str, int] = {}
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        region = node.meta.get(REGION, "")
        if kind == "all_reduce" and layout == "sp":
            raise AssertionError(
                f"sp layout: all-reduce {describe(node)} ({node.meta.get(REASON)})"
            )
        if _axis(node, ctx) == "ep":
            if kind != "all_to_all" or ".ffn" not in region:
                raise AssertionError(
                    f"{layout} layout: EP collective outside a MoE: {describe(node)}"
                )
            ep_per_region[region] = ep_per_region.get(region, 0) + 1
            continue
        match = _LAYER.match(region)
        if match:
            layer = int(match.group(1))
            (per_moe if ".ffn" in region else per_layer)[layer].append(node)
    for layer in layers:
        for nodes, expected, half in (
            (per_layer[layer], expected_tp, "outside its MoE"),
            (per_moe[layer], expected_moe, "in its MoE"),
        ):
            kinds = sorted(collective_kind(n) for n in nodes)
            if kinds != expected:
                raise AssertionError(
                    f"{layout} layout: layer {layer} has TP collectives {kinds} {half}, "
                    f"expected {expected}"
                )
        for n in per_layer[layer]:
            inp = n.args[0].meta["val"]
            kind = collective_kind(n)
            if kind == "all_gather" and inp.dim() != 2:
                raise AssertionError(f"sp layout: layer {layer} gathers a {inp.dim()}-D value")
            if kind in ("reduce_scatter", "all_reduce") and inp.dtype != torch.float32:
                raise AssertionError(f"{layout} layout: layer {layer} {kind}s {inp.dtype}")
    # EP: counts (exact only), token rows, routes, outputs -- per MoE layer.
    expected = {"exact": 4, "padded": 3}[ctx.options.ep_dispatch]
    for info in ctx.ep_layers:
        if ep_per_region.get(info.region) != expected:
            raise AssertionError(
                f"{layout} layout: {info.region} has {ep_per_region.get(info.region, 0)} EP "
                f"all-to-alls, expected {expected} ({ctx.options.ep_dispatch} dispatch)"
            )
