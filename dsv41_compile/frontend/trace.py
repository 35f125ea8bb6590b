"""The front porch's second step, on the rank that compiles: from the captured Dynamo graph to
the flat ATen inference graph the pipeline rewrites.

In order: the token count made a symbol (`tokens.generalized`); each kind of compiled region
traced to ATen once and its calls made operators (`regions.trace_kinds_once`); AOTAutograd's
functional inference graph of the model (the cache writes kept in it); the regions copied in at
every call under the call's module path (`regions.inline_regions`). The graph is taken from
AOTAutograd as it is handed to a compiler, and the callable AOTAutograd returns -- its runtime
wrapper, what Dynamo calls -- runs the per-rank program `Traced.bind` gives it once the
pipeline and the target have made it. torch's meta kernels of a few ops are replaced for the
whole step (`meta_kernels`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.fx import GraphModule
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.torch_private import aot_module_simplified, sym_expr
from dsv41_compile.frontend.capture import Captured, mark_call
from dsv41_compile.frontend.meta_kernels import size_oblivious_meta
from dsv41_compile.frontend.regions import (
    inline_regions,
    renamed_symbols,
    trace_kinds_once,
    trace_regions_with_meta,
)
from dsv41_compile.frontend.tokens import branches_on_tokens, generalized, specializes_tokens

__all__ = ["Traced", "trace"]


class _Deferred:
    """What AOTAutograd is handed as the compiled graph: calls the program bound later."""

    _boxed_call = True

    def __init__(self) -> None:
        self.program: Callable[[list[Any]], Any] | None = None

    def __call__(self, args: list[Any]) -> Any:
        if self.program is None:
            raise InternalError("the compiled model was called before its program was bound")
        return self.program(args)


@dataclass
class Traced:
    """The front porch's result: the ATen graph and its inputs (fakes, the token count an
    unbacked symbol), what each step took, and what Dynamo is to call."""

    gm: GraphModule
    inputs: list[Any]
    runtime: Callable[..., Any]
    """AOTAutograd's runtime wrapper: what the backend returns to Dynamo."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """`generalize`, `kinds`, `aot`, `inline`."""
    kinds_traced: int = 0
    """Region kinds traced to ATen (each once)."""
    _deferred: _Deferred = field(default_factory=_Deferred)

    def bind(self, program: Callable[[list[Any]], Any]) -> Callable[..., Any]:
        """Make `program` (boxed: it takes the list of inputs) what the runtime wrapper runs;
        return the runtime wrapper."""
        self._deferred.program = program
        return self.runtime


def trace(
    captured: Captured, decompositions: Mapping[Any, Callable[..., Any]] | None = None
) -> Traced:
    """The flat ATen inference graph of `captured` (the module docstring), the ops of
    `decompositions` traced as their decompositions (the model's fused ops a lowering without
    fused kernels computes as ATen: `ModelAdapter.decomposed`)."""
    decompositions = dict(decompositions or {})
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    with size_oblivious_meta():
        gm, example_inputs = generalized(captured)
        trace_regions_with_meta(gm)  # each layer kind's ATen nodes with their module paths
        seconds["generalize"] = time.perf_counter() - start
        kinds = trace_kinds_once(
            gm, renamed_symbols(captured.example_inputs, example_inputs), decompositions
        )
        seconds["kinds"] = time.perf_counter() - start - sum(seconds.values())
        try:
            deferred = _Deferred()
            aten_gm, aten_inputs, runtime = _aot(
                gm, example_inputs, captured, deferred, decompositions
            )
            seconds["aot"] = time.perf_counter() - start - sum(seconds.values())
            _check_token_count(gm, aten_inputs, captured)
            kinds.attach(aten_gm)
            inline_regions(aten_gm)
            seconds["inline"] = time.perf_counter() - start - sum(seconds.values())
        finally:
            kinds.close()
    return Traced(aten_gm, aten_inputs, runtime, seconds, len(kinds.bodies), deferred)


def _aot(
    gm: GraphModule,
    example_inputs: list[Any],
    captured: Captured,
    deferred: _Deferred,
    decompositions: dict[Any, Callable[..., Any]],
) -> tuple[GraphModule, list[Any], Callable[..., Any]]:
    """AOTAutograd's inference graph of `gm`, its inputs, and its runtime wrapper (which will
    call `deferred`)."""
    graphs: list[tuple[GraphModule, list[Any]]] = []

    def take(gm: GraphModule, example_inputs: Sequence[Any]) -> _Deferred:
        graphs.append((gm, cast(list[Any], example_inputs)))  # AOTAutograd passes a list
        return deferred

    try:
        runtime = aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=take,
            inference_compiler=take,
            decompositions=decompositions,
            keep_inference_input_mutations=True,  # the cache writes stay in the graph
        )
    except GuardOnDataDependentSymNode as error:
        # Dynamo traced T as a backed size, where the op's branch on T passed; which op
        # branches is found by running the graph again on the symbolic inputs
        explained = branches_on_tokens(gm, captured.symbolic_inputs(captured.fakes))
        if explained is None:
            raise
        raise explained from error
    (aten_gm, aten_inputs), *_ = graphs
    return aten_gm, aten_inputs, runtime


def _check_token_count(gm: GraphModule, aten_inputs: list[Any], captured: Captured) -> None:
    """The token count must still be a symbol in AOTAutograd's graph: name the op that made it
    a number (`tokens.specializes_tokens`)."""
    count = aten_inputs[captured.token_index].shape[0]
    if isinstance(count, torch.SymInt) and not sym_expr(count).is_number:
        return
    inputs = captured.symbolic_inputs(captured.fakes)
    specialized = specializes_tokens(gm, inputs, captured.token_index, mark_call(captured.adapter))
    if specialized is not None:
        raise specialized
