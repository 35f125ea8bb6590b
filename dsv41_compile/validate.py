"""validate: re-run fake propagation on the per-rank graph and check what the layout promises.

Requires: localize. Ensures: every node's value (`meta["val"]`) is the local one, computed by
fake-tensor propagation from local inputs; each annotated node's local shape is its global
shape with sharded dims divided over tp; the graph lints; the layout invariants hold; and
`ctx.comm` holds one record per collective (DESIGN §5).

Layout invariants of `layout="sp"` (DESIGN §2): per decoder layer exactly one AllGather(tp),
whose input is the 2-D `[Tl, D]` attention input (not the `[Tl, n, D]` residual), and exactly one
ReduceScatter(tp), whose input is fp32; no collective in the MoE half; no all-reduce anywhere.
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

from dsv41_compile.context import CompileContext
from dsv41_compile.fx_utils import GLOBAL_VAL, OUT, REASON, REGION, describe, hint_shape

__all__ = ["COLLECTIVES", "collective_kind", "comm_records", "local_inputs", "validate"]

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
        val = node.meta.get(GLOBAL_VAL, node.meta.get("val"))
        if index in ctx.param_shards:
            _, placement = ctx.param_shards[index]
            shape = list(val.shape)
            shape[placement.dim] //= ctx.mesh.tp
            with ctx.fake_mode:
                val = torch.empty(shape, dtype=val.dtype, device=val.device)
        inputs.append(val)
    return inputs


def validate(gm: GraphModule, *, ctx: CompileContext) -> bool:
    gm.graph.lint()
    FakeTensorProp(gm, mode=ctx.fake_mode).propagate_dont_convert_inputs(*local_inputs(gm, ctx))
    _check_local_shapes(gm, ctx)
    ctx.comm[:] = comm_records(gm, ctx)
    if ctx.options.layout == "sp":
        _check_sp_layout(gm, ctx)
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
        if isinstance(placement, Shard):
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
EXAMPLE_TOKEN_COUNTS = (1, 8, 2048)


def _bytes(val: torch.Tensor, symbol: object) -> sympy.Expr:
    numel = sympy.Integer(1)
    for s in val.shape:
        numel *= s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(s)
    formula = numel * val.element_size()
    return formula.xreplace({symbol: _T}) if symbol is not None else formula


def comm_records(gm: GraphModule, ctx: CompileContext) -> list[dict[str, Any]]:
    """One record per collective: kind, axis, group size, dtype, local shapes, bytes this rank
    sends and receives (ring all-gather / reduce-scatter: (tp-1) chunks of the shard each way)
    as a formula in T and at a few token counts, layer, reason."""
    symbol, _t_hint, _ = _token_hints(ctx)
    tp = ctx.mesh.tp
    records = []
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        inp, out = node.args[0].meta["val"], node.meta["val"]
        shard = inp if kind == "all_gather" else out
        moved = (tp - 1) * _bytes(shard, symbol)
        at = {f"T={t}": int(moved.xreplace({_T: t})) for t in EXAMPLE_TOKEN_COUNTS}
        match = _LAYER.match(node.meta.get(REGION, ""))
        records.append(
            {
                "node": node.name,
                "kind": kind,
                "axis": "tp",
                "group_size": tp,
                "dtype": str(inp.dtype).removeprefix("torch."),
                "input_shape": [_fmt_size(s, symbol) for s in inp.shape],
                "output_shape": [_fmt_size(s, symbol) for s in out.shape],
                "bytes_sent": str(moved),
                "bytes_received": str(moved),
                "bytes_sent_at": at,
                "bytes_received_at": at,
                "layer": int(match.group(1)) if match else None,
                "region": node.meta.get(REGION, ""),
                "reason": node.meta.get(REASON, ""),
            }
        )
    return records


def _check_sp_layout(gm: GraphModule, ctx: CompileContext) -> None:
    layers = sorted({int(m.group(1)) for f in ctx.param_fqns.values() if (m := _LAYER.match(f))})
    per_layer: dict[int, list[Node]] = {i: [] for i in layers}
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        region = node.meta.get(REGION, "")
        if kind == "all_reduce":
            raise AssertionError(
                f"sp layout: all-reduce {describe(node)} ({node.meta.get(REASON)})"
            )
        if ".ffn" in region:
            raise AssertionError(f"sp layout: collective in the MoE half: {describe(node)}")
        match = _LAYER.match(region)
        if match:
            per_layer[int(match.group(1))].append(node)
    for layer, nodes in per_layer.items():
        kinds = sorted(collective_kind(n) for n in nodes)
        if kinds != ["all_gather", "reduce_scatter"]:
            raise AssertionError(f"sp layout: layer {layer} has collectives {kinds}")
        for n in nodes:
            inp = n.args[0].meta["val"]
            if collective_kind(n) == "all_gather" and inp.dim() != 2:
                raise AssertionError(f"sp layout: layer {layer} gathers a {inp.dim()}-D value")
            if collective_kind(n) == "reduce_scatter" and inp.dtype != torch.float32:
                raise AssertionError(f"sp layout: layer {layer} reduce-scatters {inp.dtype}")
