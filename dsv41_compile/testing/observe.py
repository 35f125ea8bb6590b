"""Observe a compile without touching the backend: through the official hooks (`core.hooks`).

- `capture_programs()`: every graph `dsv41_sp` compiles, rewritten and verified, with its
  compile context;
- `capture_lowered()`: every lowered per-rank program with its context (e.g. to read
  `program.ep_stats` after a call);
- `capture_compiled(modules)` / `capture_reference(model, modules)`: the value entering given
  modules, in the compiled per-rank graph (a probe pass records, for each module, the first
  floating-point activation entering it: its local value, a token shard where the layout shards
  tokens) and in the single-device model (forward pre-hooks).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.hooks import Hooks, installed
from dsv41_compile.core.meta import REASON, module_paths, tensor_inputs
from dsv41_compile.core.passes import Pass

__all__ = ["capture_compiled", "capture_lowered", "capture_programs", "capture_reference", "record"]


@contextmanager
def capture_programs() -> Iterator[list[tuple[GraphModule, CompileContext]]]:
    """Within the context, every graph dsv41_sp compiles is appended, rewritten and verified,
    with its compile context, to the yielded list."""
    programs: list[tuple[GraphModule, CompileContext]] = []
    with installed(Hooks(on_pipeline=lambda gm, ctx: programs.append((gm, ctx)))):
        yield programs


@contextmanager
def capture_lowered() -> Iterator[list[Any]]:
    """Within the context, every per-rank program dsv41_sp makes (`ShardedProgram`, compiled
    here or loaded from the host's cache) is appended to the yielded list."""
    lowered: list[Any] = []
    with installed(Hooks(on_program=lowered.append)):
        yield lowered


_STORE: dict[str, list[Tensor]] = {}


@torch.library.custom_op("dsv41_testing::record", mutates_args=())
def record(module: str, value: Tensor) -> None:
    """The probe node of `capture_compiled`: keeps `value` for `module`. An op, not a Python
    function, so that a probed graph can be saved for the host's other ranks and loaded there
    (`runtime.host_cache`)."""
    if module in _STORE:
        _STORE[module].append(value.detach().clone())


@record.register_fake
def _(module: str, value: Tensor) -> None:
    return None


@contextmanager
def capture_compiled(modules: Sequence[str]) -> Iterator[dict[str, list[Tensor]]]:
    """Within the context, graphs compiled by dsv41_sp record into the yielded dict
    (module FQN -> values, one per call). Use the eager lowering."""
    if not modules:
        yield {}
        return
    store: dict[str, list[Tensor]] = {m: [] for m in modules}

    def probe(gm: GraphModule, *, ctx: CompileContext) -> None:
        for module in modules:
            node = _first_entering(gm, module, ctx)
            with gm.graph.inserting_before(node[0]):
                gm.graph.call_function(torch.ops.dsv41_testing.record.default, (module, node[1]))
        gm.graph.lint()
        gm.recompile()

    tag = "capture:" + ",".join(modules)
    _STORE.update(store)
    try:
        with installed(Hooks(extra_passes=(Pass("capture", probe, cache_tag=tag),))):
            yield store
    finally:
        for module in modules:
            _STORE.pop(module, None)


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
