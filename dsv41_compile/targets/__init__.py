"""Targets: the compiler a per-rank graph is handed to.

`eager` runs the FX graph as Python; `inductor` re-traces it with inductor's decompositions
(`compile_fx`), which schedules the functional collectives like any other op, under the host's
compile lock (`targets.inductor`); `torchair` hands it to torchair's backend for graph-mode NPU
execution (`targets.torchair`), after the `graph_mode` pass has rewritten it.

A target needs the graph, fake values of its inputs (local shapes) and which inputs are
weights: `Handoff`, made from the compile context where the pipeline ran, or from a program
another rank of the host compiled (`runtime.host_cache`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.fx import GraphModule

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.errors import InternalError
from dsv41_compile.options import BackendOptions
from dsv41_compile.spmd.localize import local_inputs

__all__ = ["Handoff", "compile_graph"]


@dataclass(frozen=True)
class Handoff:
    target: str
    example_inputs: list[Any]
    """Fake values of the graph's inputs, at their local shapes."""
    param_indices: frozenset[int]
    """The inputs that are the model's weights."""
    fake_mode: Any
    options: BackendOptions
    rank: int

    @staticmethod
    def of(gm: GraphModule, ctx: CompileContext) -> Handoff:
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        params = frozenset(i for i, name in enumerate(placeholders) if name in ctx.param_fqns)
        return Handoff(
            ctx.target, local_inputs(gm, ctx), params, ctx.fake_mode, ctx.options, ctx.mesh.rank
        )


def compile_graph(gm: GraphModule, handoff: Handoff) -> Callable[..., Any]:
    """`gm` compiled for `handoff.target`: a callable taking the graph's inputs."""
    if handoff.target == "eager":
        return gm.forward
    if handoff.target == "inductor":
        from dsv41_compile.targets.inductor import compile_inductor

        return compile_inductor(gm, handoff.example_inputs)
    if handoff.target == "torchair":
        from dsv41_compile.targets.torchair import lower_torchair

        return lower_torchair(gm, handoff)
    raise InternalError(f"unknown target {handoff.target!r} got past the option checks")
