"""Official hooks into a compile: what tools and tests use instead of patching the backend.

    with dsv41_compile.core.hooks.installed(Hooks(on_pipeline=keep)):
        compiled(input_ids, positions, slots, cache)

Hooks are process-wide while installed (every graph `dsv41_sp` compiles in the block sees them)
and stack: an inner block adds to the outer one. A hook that watches the pipeline
(`after_pass`, `on_pipeline`, `stop_after`) or adds a pass without a cache tag makes the compiles
it sees run the pipeline on this rank (no program is loaded from the host's cache).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.fx import GraphModule

if TYPE_CHECKING:
    from dsv41_compile.core.context import CompileContext
    from dsv41_compile.core.passes import Pass

__all__ = ["Hooks", "PipelineStopped", "active", "installed"]


class PipelineStopped(Exception):
    """Raised after the pass named by `Hooks.stop_after`: the graph is rewritten and verified,
    nothing is lowered or run (planning on a fake world, whose collectives move no data)."""


@dataclass(frozen=True)
class Hooks:
    after_pass: Callable[[str, GraphModule, CompileContext], None] | None = None
    """Called after every pass that ran, with its name; must not change the graph."""
    on_pipeline: Callable[[GraphModule, CompileContext], None] | None = None
    """Called with the rewritten, verified graph, before it is lowered."""
    extra_passes: tuple[Pass, ...] = ()
    """Passes run after the pipeline (probes that add nodes, e.g. `testing.capture`)."""
    stop_after: str | None = None
    """Raise `PipelineStopped` once this pass has run."""
    on_program: Callable[[Any], None] | None = None
    """Called with each per-rank program, compiled here or loaded from the host's cache
    (`runtime.program.ShardedProgram`: its `spec`, `report`, and after a call its
    `ep_stats`)."""
    torchair: Any = None
    """A module to use as `torch_npu.dynamo.torchair` (`testing.torchair_standin` on a machine
    without NPUs: the graph torchair would get then runs on CPU)."""


_ACTIVE: list[Hooks] = []


def active() -> tuple[Hooks, ...]:
    return tuple(_ACTIVE)


@contextmanager
def installed(hooks: Hooks) -> Iterator[Hooks]:
    _ACTIVE.append(hooks)
    try:
        yield hooks
    finally:
        _ACTIVE.remove(hooks)
