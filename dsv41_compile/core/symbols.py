"""The graph's named sizes and the sizes placements are derived at.

Two symbols have names a person reads: `T`, the DP group's token count (the length of the token
input), and `Tl_max`, the padded EP lowering's `ep_tokens` input (the largest token shard over
the EP group). The node that holds each carries `meta[SYMBOL]`; `graph_symbols` maps their
sympy expressions to these names for printing, comm records and accounting.

Placements must not depend on the value of T. The op rules read concrete shapes (DTensor's
rules hash their specs, and refuse to shard a dim shorter than the mesh), so every size is
evaluated with the token count at `PLANNING_TOKENS`, whatever T the graph was traced with
(`hint_shape`): a decode step of one token and a prefill of thousands get the same placements.
"""

from __future__ import annotations

import warnings
import weakref

import sympy
import torch
from torch.fx import GraphModule
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols

from dsv41_compile.core.meta import SYMBOL
from dsv41_compile.core.torch_private import (
    SympyMax,
    SympyMin,
    backed_values,
    new_input_size,
    sym_expr,
    sym_shape_env,
    tree_leaves,
)

__all__ = [
    "PLANNING_TOKENS",
    "T",
    "TL_MAX",
    "graph_symbols",
    "hint",
    "hint_shape",
    "in_named_symbols",
    "is_token_count",
    "new_token_symbol",
    "new_unbacked_symbols",
    "register_token_symbol",
    "same_for_every_value",
    "size_expr",
]

T = sympy.Symbol("T", nonnegative=True, integer=True)
TL_MAX = sympy.Symbol("Tl_max", positive=True, integer=True)
NAMES = {"T": T, "Tl_max": TL_MAX}

PLANNING_TOKENS = 8192
"""The token count the op rules see. Large, so that no token dim looks like a broadcast dim or
is shorter than the mesh; a power of two, so that every padded shard length is exact. It is
also torch's fallback hint for unbacked sizes, so a graph traced with `mark_token_dim` and
one traced with a static or backed T are placed alike."""

_TOKEN_SYMBOLS: weakref.WeakKeyDictionary[ShapeEnv, set[sympy.Symbol]] = weakref.WeakKeyDictionary()
_HINTS: weakref.WeakKeyDictionary[ShapeEnv, dict[sympy.Expr, int]] = weakref.WeakKeyDictionary()


def register_token_symbol(size: object) -> None:
    """Make `size` (the token input's length) the token count of its shape env: `hint` then
    evaluates it at `PLANNING_TOKENS`. A static size has nothing to register.

    The token count is usually a symbol. It is an expression when the shape env replaced the
    symbol by one it found equal to it: `x[:1]` and `x[1:]` concatenated and met against T rows
    make `Max(0, u1 - Min(1, u1)) + Min(1, u1)` of the slice's own symbol u1. Every size the
    graph derived from T then holds that expression, which is registered as it is, and so is
    the symbol it equals for every value (`same_for_every_value`)."""
    if not isinstance(size, torch.SymInt):
        return
    env, expr = sym_shape_env(size), sym_expr(size)
    tokens = _TOKEN_SYMBOLS.setdefault(env, set())
    tokens.add(expr)
    if not isinstance(expr, sympy.Symbol):
        tokens.update(s for s in expr.free_symbols if same_for_every_value(expr, s))
    _HINTS.pop(env, None)


_PIECEWISE_LINEAR = (
    sympy.Add,
    sympy.Max,
    sympy.Min,
    SympyMax,
    SympyMin,
    sympy.Symbol,
    sympy.Integer,
)
"""(torch's shape env writes Max and Min as its own sympy functions.)"""


def same_for_every_value(expr: sympy.Expr, symbol: sympy.Symbol) -> bool:
    """Whether `expr` equals `symbol` for every value >= 0 of it: `expr` is built of sums,
    integer multiples, Max and Min of `symbol` and integers -- piecewise linear, with its
    breaks at integers no larger than the sum c of its constants' magnitudes -- and agrees
    with `symbol` at 0 .. 2c + 2 (two points beyond the last break: linear there)."""
    if expr.free_symbols != {symbol}:
        return False
    constants = 0
    for part in sympy.preorder_traversal(expr):
        if isinstance(part, sympy.Mul):  # an integer times one term
            if sum(not isinstance(a, sympy.Integer) for a in part.args) > 1:
                return False
        elif not isinstance(part, _PIECEWISE_LINEAR):
            return False
        if isinstance(part, sympy.Integer):
            constants += abs(int(part))
    return all(expr.xreplace({symbol: sympy.Integer(v)}) == v for v in range(2 * constants + 3))


def is_token_count(size: object) -> bool:
    """Whether `size` is the token count T: a registered token symbol or expression
    (`register_token_symbol`). A dim of this size is a token dim; `T - 1`, `2*T` or a number
    are not."""
    if not isinstance(size, torch.SymInt):
        return False
    return sym_expr(size) in _TOKEN_SYMBOLS.get(sym_shape_env(size), ())


def hint(size: int | torch.SymInt) -> int:
    """A concrete value of `size`: token symbols at `PLANNING_TOKENS`, other backed symbols at
    their example value, other unbacked symbols (data-dependent sizes) at `PLANNING_TOKENS`.
    Memoised per shape env: the passes ask for the same few sizes tens of thousands of times."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    env, expr = sym_shape_env(size), sym_expr(size)
    hints = _HINTS.setdefault(env, {})
    if expr not in hints:
        tokens = {s for e in _TOKEN_SYMBOLS.get(env, ()) for s in e.free_symbols}
        backed = backed_values(env)
        values = {
            s: backed[s] if s in backed and s not in tokens else PLANNING_TOKENS
            for s in expr.free_symbols
        }
        hints[expr] = int(expr.xreplace(values))
    return hints[expr]


def hint_shape(val: torch.Tensor) -> tuple[int, ...]:
    return tuple(hint(s) for s in val.shape)


def size_expr(size: object) -> sympy.Expr:
    """A size (int, SymInt, or a node holding one) as a sympy expression."""
    val = size.meta["val"] if isinstance(size, torch.fx.Node) else size
    return sympy.sympify(sym_expr(val)) if isinstance(val, torch.SymInt) else sympy.Integer(val)


def new_unbacked_symbols(result: object, inputs: object) -> set[sympy.Symbol]:
    """The data-dependent sizes (unbacked symbols) in `result` that `inputs` do not hold: sizes
    an op made of its own, different at every call. Both may nest tensors and sizes in
    lists, tuples and dicts."""
    made = free_unbacked_symbols(_sized(result))
    return set(made - free_unbacked_symbols(_sized(inputs))) if made else set()


def _sized(value: object) -> list[object]:
    return [
        v
        for v in tree_leaves(value)
        if isinstance(v, torch.Tensor | torch.SymInt | torch.SymFloat | torch.SymBool)
    ]


def graph_symbols(gm: GraphModule) -> dict[sympy.Expr, sympy.Symbol]:
    """The graph's named sizes: expression -> `T` / `Tl_max`."""
    names = {}
    for node in gm.graph.nodes:
        name = node.meta.get(SYMBOL)
        val = node.meta.get("val")
        if name is not None and isinstance(val, torch.SymInt):
            names[sym_expr(val)] = NAMES[name]
    return names


def in_named_symbols(expr: sympy.Expr, names: dict[sympy.Expr, sympy.Symbol]) -> sympy.Expr | None:
    """`expr` in T / Tl_max, or None when it depends on data (unbacked sizes with no name)."""
    expr = sympy.sympify(expr).xreplace(names)
    return expr if expr.free_symbols <= {T, TL_MAX} else None


def new_token_symbol(shape_env: ShapeEnv) -> torch.SymInt:
    """A fresh unbacked size of `shape_env` for a token count (an input, not an op's output),
    non-negative and size-oblivious as Dynamo's unbacked sizes are (`mark_token_dim`)."""
    symbol = new_input_size(shape_env)
    with warnings.catch_warnings():  # torch 2.13 warns per call that _check_is_size will go
        warnings.simplefilter("ignore", FutureWarning)
        torch._check_is_size(symbol)
    return symbol
