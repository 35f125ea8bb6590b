"""Capture the value entering given modules, in the compiled per-rank graph and in the
single-device model, without touching the model's forward.

Compiled side: `capture_compiled(modules)` adds one pass after the pipeline that records, for
each module, the first floating-point activation entering it (its local value: a token shard
where the layout shards tokens). Reference side: `capture_reference(model, modules)` records the
first floating-point positional argument of each module's forward, with pre-hooks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from torch.fx import GraphModule, Node

from dsv41_compile import passes
from dsv41_compile.context import CompileContext
from dsv41_compile.fx_utils import REASON, module_paths, tensor_inputs

__all__ = [
    "PipelineDone",
    "capture_compiled",
    "capture_lowered",
    "capture_programs",
    "capture_reference",
    "stop_after_pipeline",
]


class PipelineDone(Exception):
    """Raised by `stop_after_pipeline` once a graph is rewritten and validated."""


@contextmanager
def stop_after_pipeline() -> Iterator[None]:
    """Within the context, dsv41_sp stops after the pipeline (nothing is lowered or run): the
    compiled model's first call raises (Dynamo wraps `PipelineDone`). For tools that only look
    at the rewritten graph, e.g. on a fake process group, whose collectives move no data."""

    def stop(gm: GraphModule, *, ctx: CompileContext) -> bool:
        raise PipelineDone

    with _appended_pass("stop", stop):
        yield


@contextmanager
def capture_programs() -> Iterator[list[tuple[GraphModule, CompileContext]]]:
    """Within the context, every graph dsv41_sp compiles is appended, rewritten and validated,
    with its compile context, to the yielded list."""
    programs: list[tuple[GraphModule, CompileContext]] = []

    def keep(gm: GraphModule, *, ctx: CompileContext) -> bool:
        programs.append((gm, ctx))
        return False

    with _appended_pass("keep", keep):
        yield programs


@contextmanager
def capture_lowered() -> Iterator[list[tuple[Any, CompileContext]]]:
    """Within the context, every program dsv41_sp lowers is appended, with its compile context,
    to the yielded list: `(ShardedProgram, ctx)`; e.g. to read `program.ep_stats` after a call."""
    from dsv41_compile import backend

    lowered: list[tuple[Any, CompileContext]] = []
    original = backend.lower

    def lower(gm: GraphModule, ctx: CompileContext, *args: Any) -> Any:
        program = original(gm, ctx, *args)
        lowered.append((program, ctx))
        return program

    backend.lower = lower
    try:
        yield lowered
    finally:
        backend.lower = original


@contextmanager
def capture_compiled(modules: Sequence[str]) -> Iterator[dict[str, list[Tensor]]]:
    """Within the context, graphs compiled by dsv41_sp record into the yielded dict
    (module FQN -> values, one per call). Use the eager lowering."""
    store: dict[str, list[Tensor]] = {m: [] for m in modules}

    def record(key: str, value: Tensor) -> None:
        store[key].append(value.detach().clone())

    def capture(gm: GraphModule, *, ctx: CompileContext) -> bool:
        for module in modules:
            node = _first_entering(gm, module, ctx)
            with gm.graph.inserting_before(node[0]):
                gm.graph.call_function(record, (module, node[1]))
        gm.graph.lint()
        gm.recompile()
        return True

    with _appended_pass("capture", capture):
        yield store


@contextmanager
def _appended_pass(name: str, pass_: passes.Pass) -> Iterator[None]:
    original = passes.PIPELINE
    passes.PIPELINE = (*original, (name, pass_))
    try:
        yield
    finally:
        passes.PIPELINE = original


def _origin(node: Node) -> Node:
    # Inserted nodes (collectives, pads, slices) stand for the value they redistribute.
    while REASON in node.meta and node.op == "call_function":
        node = next(a for a in node.args if isinstance(a, Node))
    return node


def _first_entering(gm: GraphModule, module: str, ctx: CompileContext) -> tuple[Node, Node]:
    """The first model node of `module` and the value it sees of the first floating-point
    activation produced outside the module (after any redistribution)."""
    for node in gm.graph.nodes:
        if REASON in node.meta or module not in module_paths(node):
            continue
        for seen in tensor_inputs(node):
            producer = _origin(seen)
            if producer.op == "placeholder" and producer.name in ctx.param_fqns:
                continue
            if module in module_paths(producer):
                continue
            if seen.meta["val"].is_floating_point():
                return node, seen
    raise ValueError(f"no activation enters module {module} in the compiled graph")


@contextmanager
def capture_reference(
    model: nn.Module, modules: Sequence[str]
) -> Iterator[dict[str, list[Tensor]]]:
    store: dict[str, list[Tensor]] = {m: [] for m in modules}
    handles = []
    for name in modules:

        def hook(_module: nn.Module, args: tuple, name: str = name) -> None:
            first = next(a for a in args if isinstance(a, Tensor) and a.is_floating_point())
            store[name].append(first.detach().clone())

        handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()
