"""The pipeline: the named passes that turn the AOT inference graph into the per-rank graph, in
order. Each pass's module says what it requires and what it ensures; `core.passes.PassManager`
runs them (timed, logged, dumped on request, hooked)."""

from __future__ import annotations

from dsv41_compile.core.passes import Pass
from dsv41_compile.core.regions import inline_regions
from dsv41_compile.moe.expert_parallel import expert_parallel
from dsv41_compile.spmd.annotate import annotate
from dsv41_compile.spmd.entry_cut import entry_cut
from dsv41_compile.spmd.insert import insert_collectives
from dsv41_compile.spmd.localize import localize
from dsv41_compile.spmd.token_sizes import token_sizes
from dsv41_compile.spmd.verify import verify
from dsv41_compile.targets.graph_mode import graph_mode

__all__ = ["PASS_NAMES", "PIPELINE"]

PIPELINE: tuple[Pass, ...] = (
    Pass("inline_regions", inline_regions),  # each layer kind's ATen, copied in at every layer
    Pass("token_sizes", token_sizes),  # every read of T from the token input
    Pass("annotate", annotate),  # a placement per node: the plan, then the op rules
    Pass("entry_cut", entry_cut),  # per-token ops before the entry gather, if it is cheaper
    Pass("insert", insert_collectives),  # the transition table at every mismatch
    Pass("localize", localize),  # global shapes -> per-rank shapes, parameter shards
    Pass("expert_parallel", expert_parallel, enabled=lambda ctx: ctx.mesh.ep > 1),
    Pass("graph_mode", graph_mode, enabled=lambda ctx: ctx.target == "torchair"),
    Pass("verify", verify),  # fake re-propagation, local shapes, the layout's invariants
)
PASS_NAMES = tuple(p.name for p in PIPELINE)
