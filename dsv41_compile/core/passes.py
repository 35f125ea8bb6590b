"""The pass manager: runs named passes over one graph, in order.

Each `Pass` is a name, a function `run(gm, *, ctx)` that rewrites the graph in place and
documents what it requires and ensures, and a predicate saying when it runs. The manager times
every pass (`ctx.pass_seconds`), logs it (logger `dsv41_compile`, level INFO), writes the graph
after the passes named in the `dump_after` option, calls its watchers after each pass and stops
where asked (`core.hooks.pass_manager` makes one with the installed hooks), and turns a broken
invariant into an `InternalError` that names the pass and points at the graph it left
behind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch.fx import GraphModule

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.errors import InternalError

__all__ = ["GraphWriter", "Pass", "PassManager", "PipelineStopped"]

log = logging.getLogger("dsv41_compile")


def _always(ctx: CompileContext) -> bool:
    return True


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[..., object]
    """`run(gm, *, ctx)`: rewrites `gm` in place."""
    enabled: Callable[[CompileContext], bool] = _always
    """Whether the pass runs for this compile (e.g. only with expert parallelism)."""
    cache_tag: str | None = None
    """For passes added by hooks: a stable name of what they add to the graph, which becomes
    part of the host compile cache's key (`runtime.host_cache`). A hook pass without one turns
    the cache off for the compiles it sees."""


GraphWriter = Callable[[GraphModule, CompileContext, str], Path]
"""Writes the graph as text under a name (`after_insert`) and returns the file."""
Watcher = Callable[[str, GraphModule, CompileContext], None]
"""Called after a pass ran, with its name; must not change the graph."""


class PipelineStopped(Exception):
    """Raised after a pass the manager was asked to stop after: the graph is rewritten as far as
    that pass, nothing is lowered or run (`Hooks.stop_after`: planning on a fake world, whose
    collectives move no data)."""


class PassManager:
    def __init__(
        self,
        passes: Sequence[Pass],
        *,
        write_graph: GraphWriter,
        watchers: Sequence[Watcher] = (),
        stop_after: Collection[str] = (),
    ) -> None:
        names = [p.name for p in passes]
        if len(set(names)) != len(names):
            raise ValueError(f"pass names must be unique, got {names}")
        self.passes = tuple(passes)
        self.write_graph = write_graph
        self.watchers = tuple(watchers)
        self.stop_after = frozenset(stop_after)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.passes)

    def run(self, gm: GraphModule, ctx: CompileContext) -> None:
        for p in self.passes:
            if not p.enabled(ctx):
                log.debug("pass %s: skipped", p.name)
                continue
            start = time.perf_counter()
            try:
                p.run(gm, ctx=ctx)
            except InternalError as error:
                raise self._report(error, p, gm, ctx) from None
            except AssertionError as error:  # an assert of a pass: the same kind of bug
                raise self._report(InternalError(str(error)), p, gm, ctx) from error
            seconds = time.perf_counter() - start
            ctx.pass_seconds[p.name] = ctx.pass_seconds.get(p.name, 0.0) + seconds
            log.info("pass %s: %.2f s, %d nodes", p.name, seconds, len(gm.graph.nodes))
            if p.name in ctx.options.dump_after:
                self.write_graph(gm, ctx, f"after_{p.name}")
            for watch in self.watchers:
                watch(p.name, gm, ctx)
            if p.name in self.stop_after:
                raise PipelineStopped(p.name)

    def _report(
        self, error: InternalError, p: Pass, gm: GraphModule, ctx: CompileContext
    ) -> InternalError:
        error.pass_name = p.name
        try:
            error.graph_path = str(self.write_graph(gm, ctx, f"failed_{p.name}"))
        except Exception as write_error:  # the report must survive a graph it cannot print
            error.graph_path = f"(not written: {write_error})"
        return error
