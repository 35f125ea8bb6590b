"""The pipeline: the named passes, in order. Each is `pass_(gm, *, ctx) -> bool` and documents
what it requires and ensures."""

from __future__ import annotations

from collections.abc import Callable

from torch.fx import GraphModule

from dsv41_compile.collectives.expert_parallel import expert_parallel
from dsv41_compile.collectives.insert import insert_collectives
from dsv41_compile.context import CompileContext
from dsv41_compile.localize import localize
from dsv41_compile.lowering.graph_mode import graph_mode
from dsv41_compile.propagation.annotate import annotate
from dsv41_compile.validate import validate

__all__ = ["PIPELINE", "run_pipeline"]

Pass = Callable[..., bool]

PIPELINE: tuple[tuple[str, Pass], ...] = (
    ("annotate", annotate),
    ("insert", insert_collectives),
    ("localize", localize),
    ("expert_parallel", expert_parallel),
    ("graph_mode", graph_mode),  # lowering="torchair" only
    ("validate", validate),
)


def run_pipeline(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    for _name, pass_ in PIPELINE:
        pass_(gm, ctx=ctx)
    return gm
