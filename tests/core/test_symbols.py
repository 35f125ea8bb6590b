"""The token count as the op rules see it (`core.symbols`): a registered symbol, or the
expression torch's shape env replaced it with, evaluated at `PLANNING_TOKENS`."""

from __future__ import annotations

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from dsv41_compile.core.symbols import (
    PLANNING_TOKENS,
    hint,
    is_token_count,
    register_token_symbol,
    same_for_every_value,
)


def test_expressions_equal_to_their_symbol_for_every_value_are_told_from_others():
    u = sympy.Symbol("u1", integer=True, nonnegative=True)
    # the rows of x[:1] and x[1:] concatenated
    assert same_for_every_value(sympy.Max(0, u - sympy.Min(1, u)) + sympy.Min(1, u), u)
    assert same_for_every_value(2 * u - u, u)
    assert not same_for_every_value(sympy.Max(0, u - 1), u)  # 0 at u = 0, u - 1 after
    assert not same_for_every_value(sympy.Max(2, u), u)
    assert not same_for_every_value(sympy.Min(8, u), u)  # u up to 8 only
    assert not same_for_every_value(u * u, u)


def test_a_token_count_the_shape_env_made_an_expression_is_still_the_token_count():
    env = ShapeEnv()
    u = env.create_unbacked_symint()
    rows = torch.sym_max(0, u - torch.sym_min(1, u)) + torch.sym_min(1, u)  # x[:1], x[1:]
    register_token_symbol(rows)
    assert is_token_count(rows) and is_token_count(u)
    assert not is_token_count(u - 1) and not is_token_count(2 * u)
    assert hint(rows) == hint(u) == PLANNING_TOKENS
