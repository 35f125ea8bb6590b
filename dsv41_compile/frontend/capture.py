"""The front porch's first step, on every rank: Dynamo's graph read once -- what each input is,
which model family it is, how Dynamo traced the token count -- and what a user can get wrong
refused before anything is traced (a piece of the model, past the recompile limit, misnamed
inputs, a training graph, parameters without weights)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from dsv41_compile.core.adapter import ModelAdapter
from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.meta import module_paths
from dsv41_compile.core.symbols import new_token_symbol
from dsv41_compile.core.torch_private import (
    DynamoCompileContext,
    TracingContext,
    is_fake,
    recompile_limit,
    sym_expr,
)
from dsv41_compile.families import adapter_for, options_for
from dsv41_compile.options import BackendOptions
from dsv41_compile.storage import has_no_weights

__all__ = ["Captured", "GraphInputs", "capture", "computes_no_tensor", "mark_call", "read_inputs"]

_SOURCE_KEYS = re.compile(r"\['([^']+)'\]")


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
    options: BackendOptions
    """The options, the family's own as its class (`families.options_for`)."""

    @property
    def planning(self) -> bool:
        return self.device_type == "meta"

    def param_shapes(self) -> dict[str, Any]:
        return {fqn: self.example_inputs[i].shape for i, fqn in self.inputs.param_fqns.items()}

    def symbolic_inputs(self, values: list[Any]) -> list[Any]:
        """`values` (the inputs, or their fakes) with the token inputs' length a fresh
        unbacked symbol (and a backed token symbol Dynamo passes as an int input replaced by
        it): what AOTAutograd and the targets trace with, whatever T Dynamo traced."""
        count = self.count
        if count is None:
            return values
        fake_mode = TracingContext.get().fake_mode
        if fake_mode.shape_env is None:
            raise InternalError("Dynamo's fake mode has no shape env")
        u = new_token_symbol(fake_mode.shape_env)
        generalized = list(values)
        if isinstance(count, torch.SymInt):
            # A backed symbol (automatic dynamic, dynamic=True): the same graph, traced again
            # with an unbacked one. Backed sizes are reasoned about at their example value, and
            # a token-shard length whose example is 1 makes views of it come out wrong.
            for i, x in enumerate(values):
                if isinstance(x, torch.SymInt) and sym_expr(x) == sym_expr(count):
                    generalized[i] = u
        for name in self.adapter.token_inputs:
            index = self.inputs.index_of(name)
            if index is None:  # the family's adapter matched the graph by its inputs
                raise InternalError(f"the graph has no token input {name}")
            real = values[index]
            with fake_mode:
                generalized[index] = torch.empty((u,), dtype=real.dtype, device=real.device)
        return generalized


def computes_no_tensor(gm: GraphModule) -> bool:
    """Whether Dynamo's graph computes no tensor: none of its ops makes one and it returns none
    (at most sizes read and compared). Dynamo hands the backend such a graph where the code it
    traces calls what it cannot trace before any tensor op -- a model refusing a batch it was
    given (DeepSeek V4.1's `check_batch_shapes`): there is nothing to place, and the graph runs
    as it is."""

    def tensors(value: Any) -> bool:
        if isinstance(value, (tuple, list)):
            return any(tensors(v) for v in value)
        return isinstance(value, torch.Tensor)

    for node in gm.graph.nodes:
        if node.op == "call_module":
            return False
        if node.op == "output":
            returned = node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
            if any(tensors(getattr(r, "meta", {}).get("example_value")) for r in returned):
                return False
        elif node.op != "placeholder" and tensors(node.meta.get("example_value")):
            return False
    return True


def capture(gm: GraphModule, example_inputs: list[Any], options: BackendOptions) -> Captured:
    """Dynamo's graph read: its inputs, its family (which must have `options.layout`, and the
    family's options among `options`), its token count; a ValueError that says what to change
    for a graph the backend cannot compile (a piece of the model, past the recompile limit,
    misnamed inputs, a training graph, parameters without weights)."""
    inputs = read_inputs(gm)
    adapter = adapter_for(inputs.param_fqns.values(), inputs.input_names.values(), options.layout)
    options = options_for(options, adapter)
    _check_recompiles(adapter)
    _check_whole_model(gm, adapter)
    token_index = _token_index(inputs, adapter)  # before AOTAutograd: a misnamed input fails
    _check_inputs(example_inputs, inputs, adapter)
    _check_inference(example_inputs, inputs)
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    device_type = tensors[0].device.type if tensors else "cpu"
    if device_type != "meta" and options.checkpoint is None:
        _check_weights(example_inputs, inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    count = placeholders[token_index].meta["example_value"].shape[0]
    if isinstance(count, torch.SymInt) and free_unbacked_symbols(sym_expr(count)):
        count = None
    fake_mode = TracingContext.get().fake_mode
    fakes = [
        fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not is_fake(x) else x
        for x in example_inputs
    ]
    return Captured(
        gm, example_inputs, fakes, inputs, adapter, token_index, count, device_type, options
    )


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


def _check_inputs(example_inputs: list[Any], inputs: GraphInputs, adapter: ModelAdapter) -> None:
    """The family's check of the inputs Dynamo was called with (`ModelAdapter.check_inputs`),
    where they hold their sizes: a model checks its batch itself (DeepSeek V4.1's forward does),
    but with the token count marked (`mark_token_dim`) its comparison of lengths cannot decide
    while Dynamo traces."""
    named = {name: example_inputs[i] for i, name in inputs.input_names.items()}
    sized = {
        name: value
        for name, value in named.items()
        if not isinstance(value, torch.Tensor) or all(isinstance(n, int) for n in value.shape)
    }
    adapter.check_inputs(sized)


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


def mark_call(adapter: ModelAdapter) -> str:
    """How the user marks the token dim: `dsv41_compile.mark_token_dim(<the token inputs>)`."""
    return f"dsv41_compile.mark_token_dim({', '.join(adapter.token_inputs)})"
