"""Targets: the compiler a per-rank graph is handed to.

`eager` runs the FX graph as Python; `inductor` re-traces it with inductor's decompositions
(`compile_fx`), which schedules the functional collectives like any other op, under the host's
compile lock (`targets.inductor`); `torchair` hands it to torchair's backend for graph-mode NPU
execution (`targets.torchair`), after the `graph_mode` pass has rewritten it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.fx import GraphModule

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.errors import InternalError
from dsv41_compile.spmd.localize import local_inputs

__all__ = ["compile_graph"]


def compile_graph(gm: GraphModule, ctx: CompileContext) -> Callable[..., Any]:
    """`gm` compiled for `ctx.target`: a callable taking the graph's inputs."""
    if ctx.target == "eager":
        return gm.forward
    if ctx.target == "inductor":
        from dsv41_compile.targets.inductor import compile_inductor

        return compile_inductor(gm, local_inputs(gm, ctx))
    if ctx.target == "torchair":
        from dsv41_compile.targets.torchair import lower_torchair

        return lower_torchair(gm, ctx)
    raise InternalError(f"unknown target {ctx.target!r} got past the option checks")
