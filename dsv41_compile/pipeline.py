"""The pipeline: the named passes that turn the flat ATen inference graph (the front porch's,
`frontend.trace`) into the per-rank graph, in order. Each pass's module says what it requires and what it ensures; `core.passes.PassManager`
runs them (timed, logged, dumped on request, hooked).

The rewrites are the same for every target; a target adds the passes it needs after them
(`targets.Target.passes`: torchair's `graph_mode`), and verify checks the result last.
"""

from __future__ import annotations

from dsv41_compile.core.passes import Pass
from dsv41_compile.moe.expert_parallel import expert_parallel
from dsv41_compile.options import BackendOptions
from dsv41_compile.spmd.annotate import annotate
from dsv41_compile.spmd.coalesce import coalesce_gathers
from dsv41_compile.spmd.entry_cut import entry_cut
from dsv41_compile.spmd.insert import insert_collectives
from dsv41_compile.spmd.localize import localize
from dsv41_compile.spmd.one_rank import drop_one_rank_collectives
from dsv41_compile.spmd.quantised_transport import quantised_transport
from dsv41_compile.spmd.token_shifts import token_shifts
from dsv41_compile.spmd.token_sizes import token_sizes
from dsv41_compile.tables.exchange import table_exchange
from dsv41_compile.targets import TARGETS, Target
from dsv41_compile.verify import verify

__all__ = ["REWRITES", "VERIFY", "check_dump_after", "pass_names", "passes"]

REWRITES: tuple[Pass, ...] = (
    Pass("token_sizes", token_sizes),  # every read of T from the token input
    Pass("annotate", annotate),  # a placement per node: the plan, then the op rules
    Pass("token_shifts", token_shifts),  # a shift of a token shard: one op, on the shard
    Pass("entry_cut", entry_cut),  # per-token ops before the entry gather, if it is cheaper
    Pass("insert", insert_collectives),  # the transition table at every mismatch
    Pass("localize", localize),  # global shapes -> per-rank shapes, the program's signature
    Pass("expert_parallel", expert_parallel, enabled=lambda ctx: ctx.mesh.ep > 1),
    Pass("tables", table_exchange, enabled=lambda ctx: ctx.mesh.ep > 1),  # column-split tables
    # a TP collective of what the activation quantisation makes or only feeds: quantised rows
    Pass("quantised_transport", quantised_transport),
    Pass("coalesce", coalesce_gathers),  # a layer's entry gathers as one AllGather
    # tp=1: the TP collectives over a group of one rank removed
    Pass("one_rank", drop_one_rank_collectives, enabled=lambda ctx: ctx.mesh.tp == 1),
)
VERIFY = Pass("verify", verify)  # fake re-propagation, local shapes, the layout's invariants


def passes(target: Target) -> tuple[Pass, ...]:
    """The passes a compile for `target` runs, in order."""
    return (*REWRITES, *target.passes, VERIFY)


def pass_names() -> tuple[str, ...]:
    """Every pass some compile runs, in order (what `dump_after` may name): the registered
    targets' passes among them."""
    every = (*REWRITES, *(p for t in TARGETS.values() for p in t.passes), VERIFY)
    return tuple(dict.fromkeys(p.name for p in every))


def check_dump_after(options: BackendOptions) -> None:
    """A ValueError when the `dump_after` option names no pass."""
    names = pass_names()
    unknown = sorted(set(options.dump_after) - set(names))
    if unknown:
        raise ValueError(f"dump_after names no pass: {unknown}; the passes are {names}")
