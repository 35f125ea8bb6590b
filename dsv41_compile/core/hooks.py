"""Official hooks into a compile: what tools and tests use instead of patching the backend.

    with dsv41_compile.core.hooks.installed(Hooks(on_pipeline=keep)):
        compiled(input_ids, positions, slots, cache)

Hooks are process-wide while installed (every graph `dsv41_sp` compiles in the block sees them)
and stack: an inner block adds to the outer one. `pass_manager` builds the pipeline's pass
manager with the installed hooks. A hook that watches the pipeline
(`after_pass`, `on_pipeline`, `stop_after`) or adds a pass without a cache tag makes the compiles
it sees run the pipeline on this rank (no program is loaded from the host's cache).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch.fx import GraphModule

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.passes import GraphWriter, Pass, PassManager, PipelineStopped

__all__ = ["Hooks", "PipelineStopped", "active", "installed", "pass_manager"]


@dataclass(frozen=True)
class Hooks:
    after_pass: Callable[[str, GraphModule, CompileContext], None] | None = None
    """Called after every pass that ran, with its name; must not change the graph."""
    on_pipeline: Callable[[GraphModule, CompileContext], None] | None = None
    """Called with the rewritten, verified graph, before it is lowered."""
    extra_passes: tuple[Pass, ...] = ()
    """Passes run after the pipeline (probes that add nodes, e.g. `testing.observe`)."""
    stop_after: str | None = None
    """Raise `PipelineStopped` once this pass has run."""
    on_program: Callable[[Any], None] | None = None
    """Called with each per-rank program, compiled here or loaded from the host's cache
    (`runtime.program.ShardedProgram`: its `spec`, `report`, and after a call its
    `ep_stats`)."""
    torchair: Any = None
    """A module to use as `torch_npu.dynamo.torchair` (`testing.torchair_standin` on a machine
    without NPUs: the graph torchair would get then runs on CPU)."""
    npugraph_ex: Any = None
    """A module to use as torch_npu's `npugraph_ex` (`testing.npugraph_ex_standin` on a machine
    without NPUs: the graph npugraph_ex would get then runs on CPU)."""


_ACTIVE: list[Hooks] = []


def active() -> tuple[Hooks, ...]:
    return tuple(_ACTIVE)


def pass_manager(passes: Sequence[Pass], *, write_graph: GraphWriter) -> PassManager:
    """A manager of `passes`, then the installed hooks' extra passes, watched by their
    `after_pass` and stopped by their `stop_after`."""
    hooks = active()
    return PassManager(
        (*passes, *(p for h in hooks for p in h.extra_passes)),
        write_graph=write_graph,
        watchers=[h.after_pass for h in hooks if h.after_pass is not None],
        stop_after={h.stop_after for h in hooks if h.stop_after},
    )


@contextmanager
def installed(hooks: Hooks) -> Iterator[Hooks]:
    _ACTIVE.append(hooks)
    try:
        yield hooks
    finally:
        _ACTIVE.remove(hooks)
