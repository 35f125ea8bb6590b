"""From Dynamo's graph to the one the pipeline compiles: `capture` reads what each input is,
which model family it is and how Dynamo traced the token count, and checks what a user can get
wrong before anything is compiled; the `Captured` program it returns gives the graph with a
symbolic token count however Dynamo traced it (`Captured.generalized`).

Dynamo traces the first call with static sizes, the next ones with a backed symbol for the
token count (automatic dynamic, or `dynamic=True`) except at T = 0 and T = 1, which it always
specialises; `mark_token_dim` gives an unbacked symbol. A static trace is not something the
sharding can be derived from: at T = 1 the decompositions fold the token dim away, and a
literal `T` in a view cannot be told from another size of the same value. So a graph with a
static token count is first made symbolic (`generalize_token_count`), and every graph reaches
AOTAutograd with the token count as a symbol: the same placements and the same collectives for
every T. A static graph remains a graph for its own T -- Dynamo's guards call it only with that
T, and values Dynamo computed from T (`T - 1` as a number) stay as traced.

A model's compiled regions (`regions`: a decoder layer, traced once per kind)
stay regions, each kind traced to ATen once by the backend; a static graph's are copied in
first, since making its token count symbolic reads every op.

A token count that is a symbol must trace like an ordinary size. torch's meta kernels of
`roll`, `cummax` and `cummin` branch on `numel() == 0` before making a shape that does not
depend on it, which an unbacked T cannot decide: Dynamo refuses the op under `mark_token_dim`,
and so would the generalization of a static graph. Importing this module gives them kernels
without the branch (`SIZE_OBLIVIOUS_META`; the same output shape, dtype and layout). An op
that truly branches on T -- its result's shape or its values depend on whether T is 0, or 1
-- cannot serve every T from one graph: the generalization names the op, its model line and
what to write instead (`_branches_on_tokens`), and does not send the user to `mark_token_dim`,
where Dynamo would refuse the same op.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.experimental.symbolic_shapes import (
    GuardOnDataDependentSymNode,
    ShapeEnv,
    free_unbacked_symbols,
)

from dsv41_compile.core.adapter import ModelAdapter
from dsv41_compile.core.meta import module_paths, source_line
from dsv41_compile.core.symbols import same_for_every_value
from dsv41_compile.core.torch_private import (
    DynamoCompileContext,
    FakeTensorMode,
    TracingContext,
    enable_python_dispatcher,
    is_fake,
    recompile_limit,
    replace_meta_kernel,
)
from dsv41_compile.models import adapter_for
from dsv41_compile.options import BackendOptions
from dsv41_compile.regions import inline_dynamo_regions
from dsv41_compile.storage import has_no_weights

__all__ = [
    "SIZE_OBLIVIOUS_META",
    "Captured",
    "GraphInputs",
    "branches_on_tokens",
    "capture",
    "mark_call",
    "read_inputs",
    "specializes_tokens",
]

_SOURCE_KEYS = re.compile(r"\['([^']+)'\]")
aten = torch.ops.aten


def _roll_meta(a: torch.Tensor, shifts: Any, dims: Any = ()) -> torch.Tensor:
    # torch._refs.roll returns early for numel() == 0 (a modulo by the size follows)
    return torch.empty_like(a, memory_format=torch.contiguous_format)


def _cummaxmin_meta(a: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    # torch's checks the dim only when numel() != 0; any valid dim gives the input's shape
    ndim = max(a.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(f"Dimension out of range (expected to be in [{-ndim}, {ndim - 1}])")
    values = torch.empty(a.shape, device=a.device, dtype=a.dtype)
    return values, torch.empty(a.shape, device=a.device, dtype=torch.int64)


SIZE_OBLIVIOUS_META = {
    aten.roll.default: _roll_meta,
    aten.cummax.default: _cummaxmin_meta,
    aten.cummin.default: _cummaxmin_meta,
}
"""Ops whose meta kernels this module replaces at import (the module docstring)."""
for _op, _kernel in SIZE_OBLIVIOUS_META.items():
    replace_meta_kernel(_op, _kernel)


@dataclass(frozen=True)
class GraphInputs:
    """What each placeholder of Dynamo's graph is, by position."""

    param_fqns: dict[int, str]
    """Parameter or buffer FQN (`layers.0.attn.wq_b.weight`)."""
    input_names: dict[int, str]
    """The model input it is (`input_ids`, `cache.window_kv[0]`)."""
    buffers: frozenset[int] = frozenset()
    """The entries of `param_fqns` that are buffers, not parameters."""

    def index_of(self, name: str) -> int | None:
        return next((i for i, n in self.input_names.items() if n == name), None)


@dataclass(frozen=True)
class Captured:
    """Dynamo's graph of a whole model, read once: what the backend compiles (or loads)."""

    gm: GraphModule
    example_inputs: list[Any]
    """As Dynamo passed them (real tensors, or fake ones when it was given fakes)."""
    fakes: list[Any]
    """Dynamo's fake value of each input."""
    inputs: GraphInputs
    adapter: ModelAdapter
    """The model family's."""
    token_index: int
    """The position among the inputs of the first token input (its length is T)."""
    count: int | torch.SymInt | None
    """T as Dynamo traced it: a number, a backed symbol, or None when it is unbacked already
    (`mark_token_dim`)."""
    device_type: str
    """Where the inputs live; "meta" when planning (`planning.plan_rank`: nothing runs)."""

    @property
    def planning(self) -> bool:
        return self.device_type == "meta"

    def param_shapes(self) -> dict[str, Any]:
        return {fqn: self.example_inputs[i].shape for i, fqn in self.inputs.param_fqns.items()}

    def generalized(self) -> tuple[GraphModule, list[Any]]:
        """The graph and its inputs with the token count an unbacked symbol, when Dynamo traced
        it as a number T0 or as a backed symbol; unchanged when it is unbacked already. The
        graph is rewritten in place.

        Which numbers in a static graph are T: every int size argument equal to T0 is a
        candidate. The graph is run on fake tensors with the token inputs of length `u` and each
        candidate a symbol of its own; the shape checks of the ops then state which candidates
        equal u (a view of a token-sharded activation, an expand that meets it in a `cat`) and
        which a constant (a window of 4 when T0 = 4). The candidates equal to u become reads of
        the token input's length; the rest keep their value."""
        gm, count = self.gm, self.count
        if isinstance(count, int):
            inline_dynamo_regions(gm)  # the sizes to generalize are in every layer's ops
            token_indices = {self.inputs.index_of(name) for name in self.adapter.token_inputs}
            mark = mark_call(self.adapter)
            tokens = _token_slots(gm, self.example_inputs, token_indices, count, mark)
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            with gm.graph.inserting_after(placeholders[-1]):
                size = gm.graph.call_method("size", (placeholders[self.token_index], 0))
            for node, slot in tokens:
                node.args = _with(node.args, slot, size)
            gm.graph.lint()
            gm.recompile()
        return gm, self.symbolic_inputs(self.example_inputs)

    def symbolic_inputs(self, values: list[Any]) -> list[Any]:
        """`values` (the inputs, or their fakes) with the token inputs' length a fresh
        unbacked symbol (and a backed token symbol Dynamo passes as an int input replaced by
        it): what AOTAutograd and the targets trace with, whatever T Dynamo traced."""
        count = self.count
        if count is None:
            return values
        fake_mode = TracingContext.get().fake_mode
        shape_env = fake_mode.shape_env
        with shape_env.ignore_fresh_unbacked_symbols():  # an input, not an op's output
            u = shape_env.create_unbacked_symint()
        _is_size(u)
        generalized = list(values)
        if isinstance(count, torch.SymInt):
            # A backed symbol (automatic dynamic, dynamic=True): the same graph, traced again
            # with an unbacked one. Backed sizes are reasoned about at their example value, and
            # a token-shard length whose example is 1 makes views of it come out wrong.
            for i, x in enumerate(values):
                if isinstance(x, torch.SymInt) and x.node.expr == count.node.expr:
                    generalized[i] = u
        for name in self.adapter.token_inputs:
            i = self.inputs.index_of(name)
            real = values[i]
            with fake_mode:
                generalized[i] = torch.empty((u,), dtype=real.dtype, device=real.device)
        return generalized


def capture(gm: GraphModule, example_inputs: list[Any], options: BackendOptions) -> Captured:
    """Dynamo's graph read: its inputs, its family (which must have `options.layout`), its
    token count; a ValueError that says what to change for a graph the backend cannot compile
    (a piece of the model, past the recompile limit, misnamed inputs, a training graph,
    parameters without weights)."""
    inputs = read_inputs(gm)
    adapter = adapter_for(inputs.param_fqns.values(), inputs.input_names.values(), options.layout)
    _check_recompiles(adapter)
    _check_whole_model(gm, adapter)
    token_index = _token_index(inputs, adapter)  # before AOTAutograd: a misnamed input fails
    _check_inference(example_inputs, inputs)
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    device_type = tensors[0].device.type if tensors else "cpu"
    if device_type != "meta" and options.checkpoint is None:
        _check_weights(example_inputs, inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    count = placeholders[token_index].meta["example_value"].shape[0]
    if isinstance(count, torch.SymInt) and free_unbacked_symbols(count.node.expr):
        count = None
    fake_mode = TracingContext.get().fake_mode
    fakes = [
        fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not is_fake(x) else x
        for x in example_inputs
    ]
    return Captured(gm, example_inputs, fakes, inputs, adapter, token_index, count, device_type)


def _fqn(source: str) -> str | None:
    """`L['self']._modules['layers']._modules['0']._parameters['w']` -> `layers.0.w`."""
    if not source.startswith("L['self']") or not re.search(r"_(parameters|buffers)\[", source):
        return None
    return ".".join(_SOURCE_KEYS.findall(source.removeprefix("L['self']")))


def _input_name(source: str) -> str:
    """`L['cache'].window_kv[0]` -> `cache.window_kv[0]`."""
    return re.sub(r"^L\['([^']+)'\]", r"\1", source)


def read_inputs(gm: GraphModule) -> GraphInputs:
    params, inputs, buffers = {}, {}, set()
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        grapharg = node.meta.get("grapharg")
        source = grapharg.source.name if grapharg is not None else node.name
        fqn = _fqn(source)
        if fqn is not None:
            params[i] = fqn
            if "._buffers[" in source:
                buffers.add(i)
        else:
            inputs[i] = _input_name(source)
    return GraphInputs(params, inputs, frozenset(buffers))


def _token_index(inputs: GraphInputs, adapter: ModelAdapter) -> int:
    """The index among the graph's inputs of the model's first token input."""
    token = inputs.index_of(adapter.token_inputs[0])
    if token is None:
        names = sorted({n for n in inputs.input_names.values() if ".size()" not in n})
        raise ValueError(
            f"dsv41_sp expects the {adapter.name} model's inputs "
            f"{', '.join(adapter.token_inputs)}: no input named {adapter.token_inputs[0]} among "
            f"{names}"
        )
    return token


def _check_weights(example_inputs: list[Any], inputs: GraphInputs) -> None:
    """Without the `checkpoint` option the program runs on the model's parameters: each must
    have its values."""
    empty = [
        fqn
        for i, fqn in inputs.param_fqns.items()
        if i not in inputs.buffers and has_no_weights(example_inputs[i])
    ]
    if empty:
        raise ValueError(
            f"{len(empty)} parameters of this model have no weights ({empty[0]}, ...): pass "
            "options checkpoint=DIR (each rank reads only its own shards), or load the weights "
            "into the model first"
        )


def _check_inference(example_inputs: list[Any], inputs: GraphInputs) -> None:
    """AOTAutograd traces a training graph when a parameter requires grad in grad mode."""
    if not torch.is_grad_enabled():
        return
    trained = [fqn for i, fqn in inputs.param_fqns.items() if example_inputs[i].requires_grad]
    if trained:
        raise ValueError(
            f"dsv41_sp compiles inference graphs, but {len(trained)} parameters of this model "
            f"require grad ({trained[0]}, ...) and grad mode is on; call the compiled model "
            "under torch.no_grad() or torch.inference_mode(), or call "
            "model.requires_grad_(False) first"
        )


def _check_recompiles(adapter: ModelAdapter) -> None:
    """Refuse the compile that uses up Dynamo's recompile limit for the frame: past it, Dynamo
    runs the frame eagerly -- the single-device model, unsharded, on every rank, silently."""
    compile_id = DynamoCompileContext.current_compile_id()
    limit = recompile_limit()
    if compile_id is None or compile_id.frame_compile_id is None:
        return
    if compile_id.frame_compile_id + 1 >= limit:
        raise ValueError(
            f"dsv41_sp: this is Dynamo's compile {compile_id.frame_compile_id + 1} of this model "
            f"and its recompile limit is {limit}: past it, Dynamo would run the model eagerly -- "
            "unsharded, the whole model on every rank. With static token counts "
            f"(dynamic=False) every new T is a new graph: call {mark_call(adapter)} before "
            "each call (one graph for every T), or raise torch._dynamo.config.recompile_limit"
        )


def _check_whole_model(gm: GraphModule, adapter: ModelAdapter) -> None:
    seen = {p.split(".")[0] for n in gm.graph.nodes for p in module_paths(n)}
    missing = [m for m in adapter.whole_model_modules if m not in seen]
    if missing:
        raise ValueError(
            "dsv41_sp compiles the whole model as one graph, but this graph has no "
            f"{' / '.join(missing)} module: Dynamo split the model at a graph break. Compile "
            "with torch.compile(..., fullgraph=True) to see where, and remove the break."
        )


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
        return [(1, i) for i in range(len(node.args[1]))]
    elif node.op == "call_function" and node.target in _FACTORIES and node.args:
        if node.target is torch.arange and len(node.args) != 1:
            return []  # arange(start, end, ...): not a size
        first = 0
    else:
        return []
    if len(node.args) == first + 1 and isinstance(node.args[first], (list, tuple)):
        return [(first, i) for i in range(len(node.args[first]))]
    return [(i, None) for i in range(first, len(node.args))]


def _get(node: Node, slot: Slot) -> object:
    position, index = slot
    return node.args[position] if index is None else node.args[position][index]


def _with(args: tuple, slot: Slot, value: object) -> tuple:
    position, index = slot
    args = list(args)
    if index is None:
        args[position] = value
    else:
        seq = list(args[position])
        seq[index] = value
        args[position] = tuple(seq) if isinstance(args[position], tuple) else seq
    return tuple(args)


def _is_size(symbol: torch.SymInt) -> None:
    """`torch._check_is_size`: non-negative, and size-oblivious where Dynamo's unbacked symbols
    are (what `mark_token_dim` gives); without the FutureWarning torch 2.13 prints per call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch._check_is_size(symbol)


def mark_call(adapter: ModelAdapter) -> str:
    """How the user marks the token dim: `dsv41_compile.mark_token_dim(<the token inputs>)`."""
    return f"dsv41_compile.mark_token_dim({', '.join(adapter.token_inputs)})"


def _token_slots(
    gm: GraphModule, example_inputs: list[Any], token_indices: set[int], count: int, mark: str
) -> list[tuple[Node, Slot]]:
    """The size arguments of `gm` that are the token count (see `generalize_token_count`);
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
    u = shape_env.create_unbacked_symint()
    _is_size(u)
    symbols: dict[tuple[Node, Slot], torch.SymInt] = {}
    for candidate in candidates:
        symbols[candidate] = shape_env.create_unbacked_symint()
        _is_size(symbols[candidate])
    fakes = []
    for i, x in enumerate(example_inputs):
        if i in token_indices:
            with mode:
                fakes.append(torch.empty((u,), dtype=x.dtype, device=x.device))
        elif isinstance(x, torch.Tensor):
            fakes.append(mode.from_tensor(x))
        elif isinstance(x, torch.SymInt):
            # An int input Dynamo made a symbol (dynamic=True: a cache's max_len): its symbol
            # lives in Dynamo's shape env, not in this one; its example value stands in.
            fakes.append(x.node.hint if x.node.hint is not None else x)
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
    token_class = classes(u.node.expr)
    return [c for c, symbol in symbols.items() if classes(symbol.node.expr) == token_class]


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
            if count.node.expr.is_number:
                raise _Specialized(node, int(count.node.expr))
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

    for a, b in shape_env.replacements.items():
        union(a, b)
    for asserts in shape_env.deferred_runtime_asserts.values():
        for ra in asserts:
            if isinstance(ra.expr, sympy.Eq):
                union(*ra.expr.args)
    return find
