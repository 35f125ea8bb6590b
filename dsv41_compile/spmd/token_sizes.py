"""token_sizes: every symbolic read of the token count reads the token input.

AOTAutograd materialises a symbolic size from whichever traced tensor last had it, often an
activation: `sym_size(mix, 0)` for T. After sharding that activation holds Tl rows, so the read
would change meaning. The token input (`input_ids`) is a model input every rank of the TP group
holds whole: reading T there is right on every rank.

Requires: the AOT graph and `ctx.token_input`. Ensures: every `sym_size` whose value is
`a*T + b` (integers a, b) is computed from one `sym_size(token_input, 0)` node, and the token
symbol is registered with `core.symbols` (placements are then derived at
`PLANNING_TOKENS`, whatever T the graph was traced with).
"""

from __future__ import annotations

import operator

import sympy
import torch
from torch.fx import GraphModule

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.symbols import register_token_symbol
from dsv41_compile.core.torch_private import sym_expr

__all__ = ["token_sizes"]

aten = torch.ops.aten


def token_sizes(gm: GraphModule, *, ctx: CompileContext) -> None:
    graph = gm.graph
    token = next(n for n in graph.nodes if n.name == ctx.token_input)
    count = token.meta["val"].shape[0]
    register_token_symbol(count)
    if not isinstance(count, torch.SymInt):
        return  # a static token count: no symbolic read to redirect
    symbol = sym_expr(count)
    with graph.inserting_after(token):
        read = graph.call_function(aten.sym_size.int, (token, 0))
    read.meta["val"] = count
    for node in list(graph.nodes):
        if node is read or node.target is not aten.sym_size.int:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.SymInt) or node.args[0] is token:
            continue
        linear: tuple[int, int] | None
        if sym_expr(val) == symbol:  # (a count the shape env made an expression)
            linear = (1, 0)
        elif isinstance(symbol, sympy.Symbol):
            linear = _linear_in(sympy.expand(sym_expr(val)), symbol)
        else:
            linear = None
        if linear is None:
            continue
        a, b = linear
        with graph.inserting_before(node):
            value = read
            if a != 1:
                value = graph.call_function(operator.mul, (value, a))
            if b:
                value = graph.call_function(operator.add, (value, b))
        if value is not read:
            value.meta["val"] = val
        node.replace_all_uses_with(value)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()


def _linear_in(expr: sympy.Expr, symbol: sympy.Symbol) -> tuple[int, int] | None:
    """(a, b) with `expr == a*symbol + b` for integers a >= 1, b; else None."""
    if expr.free_symbols != {symbol}:
        return None
    if not expr.is_polynomial(symbol):
        return None
    poly = sympy.Poly(expr, symbol)
    coeffs = poly.all_coeffs()
    if poly.degree() != 1 or not all(c.is_Integer for c in coeffs):
        return None
    a, b = (int(c) for c in coeffs)
    return (a, b) if a >= 1 else None
