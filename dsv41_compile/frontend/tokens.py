"""The token count made a symbol however Dynamo traced it, and the ops that will not have it so.

Dynamo traces the first call with static sizes, the next ones with a backed symbol for the
token count (automatic dynamic, or `dynamic=True`) except at T = 0 and T = 1, which it always
specialises; `mark_token_dim` gives an unbacked symbol. A static trace is not something the
sharding can be derived from: at T = 1 the decompositions fold the token dim away, and a
literal `T` in a view cannot be told from another size of the same value. So a graph with a
static token count is first made symbolic (`generalized`), and every graph reaches AOTAutograd
with the token count as a symbol: the same placements and the same collectives for every T. A
static graph remains a graph for its own T -- Dynamo's guards call it only with that T, and
values Dynamo computed from T (`T - 1` as a number) stay as traced.

An op that truly branches on T -- its result's shape or its values depend on whether T is 0,
or 1 -- cannot serve every T from one graph: the generalization names the op, its model line
and what to write instead (`_branching`), and does not send the user to `mark_token_dim`,
where Dynamo would refuse the same op. An op that makes T a number in AOTAutograd's trace is
named too (`specializes_tokens`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, cast

import sympy
import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

from dsv41_compile.core.meta import source_line
from dsv41_compile.core.symbols import new_token_symbol, same_for_every_value
from dsv41_compile.core.torch_private import (
    FakeTensorMode,
    TracingContext,
    enable_python_dispatcher,
    equalities,
    mark_unbacked,
    sym_expr,
    sym_hint,
)
from dsv41_compile.frontend.capture import Captured, mark_call
from dsv41_compile.frontend.meta_kernels import hold_during_dynamo_compiles
from dsv41_compile.frontend.regions import inline_dynamo_regions

__all__ = ["branches_on_tokens", "generalized", "mark_token_dim", "specializes_tokens"]


def mark_token_dim(*tensors: torch.Tensor) -> None:
    """Make the token dim (dim 0) of the model inputs an unbacked symbol, so that one compiled
    graph serves every token count, 0 and 1 included. Call it on `input_ids`, `positions` and
    `slots` before each call of the compiled model.

    Without it the model still compiles and runs at every T, but Dynamo decides when to trace
    again: a static graph for the first T, a dynamic one from the second T on, and a static
    graph of its own for T = 0 and for T = 1 (docs/backend.md, "Token counts").

    Marking also has Dynamo's next compiles trace a few ops' shapes without branching on T
    (`frontend.meta_kernels`); `torch.compiler.reset()` forgets that, so mark after a reset."""
    for t in tensors:
        mark_unbacked(t, 0)
    hold_during_dynamo_compiles()  # Dynamo's trace then runs the meta kernels T needs


def generalized(captured: Captured) -> tuple[GraphModule, list[Any]]:
    """The graph and its inputs with the token count an unbacked symbol, when Dynamo traced
    it as a number T0 or as a backed symbol; unchanged when it is unbacked already. The
    graph is rewritten in place.

    Which numbers in a static graph are T: every int size argument equal to T0 is a
    candidate. The graph is run on fake tensors with the token inputs of length `u` and each
    candidate a symbol of its own; the shape checks of the ops then state which candidates
    equal u (a view of a token-sharded activation, an expand that meets it in a `cat`) and
    which a constant (a window of 4 when T0 = 4). The candidates equal to u become reads of
    the token input's length; the rest keep their value."""
    gm, count = captured.gm, captured.count
    if isinstance(count, int):
        inline_dynamo_regions(gm)  # the sizes to generalize are in every layer's ops
        token_indices = {captured.inputs.index_of(name) for name in captured.adapter.token_inputs}
        mark = mark_call(captured.adapter)
        tokens = _token_slots(gm, captured.example_inputs, token_indices, count, mark)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        with gm.graph.inserting_after(placeholders[-1]):
            size = gm.graph.call_method("size", (placeholders[captured.token_index], 0))
        for node, slot in tokens:
            node.args = _with(node.args, slot, size)
        gm.graph.lint()
        gm.recompile()
    return gm, captured.symbolic_inputs(captured.example_inputs)


# Where Dynamo writes a size it read from a tensor: the size arguments of these methods and
# functions. A static trace writes the token count there as a number.
_SIZED_METHODS = {"view", "reshape", "expand", "new_zeros", "new_ones", "new_empty", "repeat"}
_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.arange}

Slot = tuple[int, int | None]
"""An int size argument of a node: (arg position, index in it when the arg is a sequence)."""


def _size_slots(node: Node) -> list[Slot]:
    if node.op == "call_method" and node.target in _SIZED_METHODS and len(node.args) > 1:
        first = 1
    elif node.op == "call_method" and node.target == "new_full":
        return [(1, i) for i in range(len(cast(Sequence[object], node.args[1])))]
    elif node.op == "call_function" and node.target in _FACTORIES and node.args:
        if node.target is torch.arange and len(node.args) != 1:
            return []  # arange(start, end, ...): not a size
        first = 0
    else:
        return []
    if len(node.args) == first + 1 and isinstance(sizes := node.args[first], (list, tuple)):
        return [(first, i) for i in range(len(sizes))]
    return [(i, None) for i in range(first, len(node.args))]


def _get(node: Node, slot: Slot) -> object:
    position, index = slot
    if index is None:
        return node.args[position]
    return cast(Sequence[object], node.args[position])[index]


def _with(args: tuple, slot: Slot, value: object) -> tuple:
    position, index = slot
    items = list(args)
    if index is None:
        items[position] = value
    else:
        seq = list(items[position])
        seq[index] = value
        items[position] = tuple(seq) if isinstance(items[position], tuple) else seq
    return tuple(items)


def _token_slots(
    gm: GraphModule,
    example_inputs: list[Any],
    token_indices: set[int | None],
    count: int,
    mark: str,
) -> list[tuple[Node, Slot]]:
    """The size arguments of `gm` that are the token count (see `generalized`);
    `mark` is how the user marks the token dim instead."""
    candidates = [
        (node, slot)
        for node in gm.graph.nodes
        for slot in _size_slots(node)
        if type(_get(node, slot)) is int and _get(node, slot) == count
    ]
    if not candidates:
        return []
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    u = new_token_symbol(shape_env)
    symbols: dict[tuple[Node, Slot], torch.SymInt] = {}
    for candidate in candidates:
        symbols[candidate] = new_token_symbol(shape_env)
    fakes: list[Any] = []
    for i, x in enumerate(example_inputs):
        if i in token_indices:
            with mode:
                fakes.append(torch.empty((u,), dtype=x.dtype, device=x.device))
        elif isinstance(x, torch.Tensor):
            fakes.append(mode.from_tensor(x))
        elif isinstance(x, torch.SymInt):
            # An int input Dynamo made a symbol (dynamic=True: a cache's max_len): its symbol
            # lives in Dynamo's shape env, not in this one; its example value stands in.
            fakes.append(sym_hint(x) if sym_hint(x) is not None else x)
        else:
            fakes.append(x)
    by_node: dict[Node, list[tuple[Slot, torch.SymInt]]] = {}
    for (node, slot), symbol in symbols.items():
        by_node.setdefault(node, []).append((slot, symbol))

    class WithSymbols(_Tracked):
        def run_node(self, node: Node) -> Any:
            if node not in by_node:
                return super().run_node(node)
            traced = node.args
            for slot, symbol in by_node[node]:
                node.args = _with(node.args, slot, symbol)
            try:
                return super().run_node(node)
            finally:
                node.args = traced

    interpreter = WithSymbols(gm)
    try:
        with mode, enable_python_dispatcher():
            interpreter.run(*fakes)
    except GuardOnDataDependentSymNode as error:
        raise _branching(interpreter.at, error) from error
    except Exception as error:
        raise ValueError(
            f"dsv41_sp got a graph traced with a static token count (T = {count}) and could "
            f"not tell which of its sizes are T ({type(error).__name__}: "
            f"{str(error).splitlines()[0]}). Call {mark} before each call: one graph then "
            "serves every T"
        ) from error
    classes = _equal_symbols(shape_env)
    token_class = classes(sym_expr(u))
    return [c for c, symbol in symbols.items() if classes(sym_expr(symbol)) == token_class]


class _Tracked(Interpreter):
    """An interpreter that knows the node it is running (`at`)."""

    at: Node | None = None

    def run_node(self, node: Node) -> Any:
        self.at = node
        return super().run_node(node)


_INSTEAD = {
    "diff": "x[1:] - x[:-1], with a cat or a pad for a row it lacks (torch.diff checks T >= 1)",
    "chunk": ("slices or masks of a size that does not depend on T (the number of chunks does)"),
    "split": ("slices or masks of a size that does not depend on T (the number of pieces does)"),
}


def _branching(node: Node | None, error: Exception) -> ValueError:
    """The error for an op whose trace branches on the token count (the module docstring)."""
    op = getattr(node.target, "__name__", str(node.target)) if node is not None else "an op"
    line = source_line(node) if node is not None else ""
    where = f"{op} at {line}" if line else op
    # "Could not guard on data-dependent expression 1 > u0 (unhinted: ...)": the expression,
    # in the token count's name
    condition = re.sub(r"^.*? expression (.*?) \(unhinted.*$", r"\1", str(error).splitlines()[0])
    condition = re.sub(r"\bu\d+\b", "T", condition)
    instead = _INSTEAD.get(
        op,
        "ops whose shapes do not depend on whether T is 0 or 1: slices of constant length "
        "(x[:-1], x[1:]), torch.cat, F.pad, and torch.where masks in place of branches",
    )
    return ValueError(
        f"dsv41_sp compiles one graph for every token count T, and {where} branches on T "
        f"({condition}): no graph can serve every T with it. Write it as {instead}"
    )


def branches_on_tokens(gm: GraphModule, inputs: list[Any]) -> ValueError | None:
    """The error naming the op of `gm` whose trace branches on the token count, when `gm` run
    on `inputs` (fakes with the token count a symbol) meets one; else None. For the errors
    of a trace that already failed (AOTAutograd's of a graph Dynamo traced with a backed T)."""
    interpreter = _Tracked(gm)
    try:
        with TracingContext.get().fake_mode, enable_python_dispatcher():
            interpreter.run(*inputs)
    except GuardOnDataDependentSymNode as error:
        return _branching(interpreter.at, error)
    except Exception:  # another failure: not this one to explain
        return None
    return None


def specializes_tokens(
    gm: GraphModule, inputs: list[Any], token_index: int, mark: str
) -> ValueError | None:
    """The error naming the op of `gm` that makes the token count a number, when `gm` run on
    `inputs` (fakes with the token count a symbol) meets one; else None. A static trace writes
    T as the number T0 wherever the model computed a size from it (`x[:T]` with
    `T = x.shape[0]`); a view's or a factory's such number is made T again
    (`Captured.generalized`), but a slice bound stays, and an op that meets the slice's rows
    against T rows then holds T equal to T0: AOTAutograd's trace would be a graph for T0 only,
    its token dim a number, which the op rules cannot tell from any other size."""
    count = inputs[token_index].shape[0]
    if not isinstance(count, torch.SymInt):
        return None

    class Watched(_Tracked):
        def run_node(self, node: Node) -> Any:
            out = super().run_node(node)
            if sym_expr(count).is_number:
                raise _Specialized(node, int(sym_expr(count)))
            return out

    interpreter = Watched(gm)
    try:
        with TracingContext.get().fake_mode, enable_python_dispatcher():
            interpreter.run(*inputs)
    except _Specialized as found:
        op = getattr(found.node.target, "__name__", str(found.node.target))
        line = source_line(found.node)
        where = f"{op} at {line}" if line else op
        return ValueError(
            f"dsv41_sp compiles one graph for every token count T, and {where} makes T the "
            f"number {found.value}: Dynamo traced the first call with static sizes, and this op "
            f"meets T rows against a size {found.value} that the backend could not tell from T "
            f"(a size given to torch.full, a slice's bound). Call {mark} before each call "
            "(Dynamo then traces T as a symbol), or make the value from a tensor with the T "
            "rows (torch.full_like(x[:, :1], v), x.new_full((T, 1), v))"
        )
    except Exception:  # another failure: not this one to explain
        return None
    return None


class _Specialized(Exception):
    def __init__(self, node: Node, value: int) -> None:
        self.node, self.value = node, value


def _equal_symbols(shape_env: ShapeEnv) -> Callable[[sympy.Expr], sympy.Expr]:
    """A function mapping a symbol to a representative of the symbols (and integers) the shape
    env found it equal to: its replacements and the equalities it deferred as runtime
    asserts. An expression of one symbol that equals it for every value (`Max(0, u - Min(1,
    u)) + Min(1, u)`, the rows of `x[:1]` and `x[1:]` concatenated) stands for the symbol."""
    parent: dict[sympy.Expr, sympy.Expr] = {}

    def plain(x: sympy.Expr) -> sympy.Expr:
        if x.is_Symbol or x.is_Integer or len(x.free_symbols) != 1:
            return x
        (symbol,) = x.free_symbols
        return symbol if same_for_every_value(x, symbol) else x

    def find(x: sympy.Expr) -> sympy.Expr:
        x = plain(x)
        while x in parent:
            x = parent[x]
        return x

    def union(a: sympy.Expr, b: sympy.Expr) -> None:
        a, b = find(a), find(b)
        if a != b and (a.is_Symbol or a.is_Integer) and (b.is_Symbol or b.is_Integer):
            if a.is_Integer:
                a, b = b, a
            parent[a] = b  # an integer, when there is one, is the representative

    for a, b in equalities(shape_env):
        union(a, b)
    return find
