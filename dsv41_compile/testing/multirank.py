"""Run a function on W real processes joined by a gloo process group (CPU), collect results.

    results = run_ranks(fn, 8, spec)   # fn(rank, world_size, spec) in each process

    pool = RankPool.shared(8)          # the processes and their process group, kept for
    a = pool.run(fn, spec_a)           # several functions (a test session): no start-up
    b = pool.run(fn, spec_b)           # per run; closed when this process exits

`fn` must be importable by module name (it is pickled by reference). The first failing rank's
traceback is re-raised in the caller. Ranks are forked from a `forkserver` that imported torch
and this package once (`_context`), so a rank starts without importing them again (about 4 s
of CPU each, which 8 ranks on 2 cores pay 4 times over); they run with the caller's
environment as it is when they start, except for what the preloaded modules read from it at
import (torch's config modules): that is the environment of the server's start, the first
run of the calling process. A pool runs each function in a clean compile state
(Dynamo reset, its counters and the host cache's statistics cleared); after a failed run it
restarts its processes, since a rank may have been left inside a collective.
"""

from __future__ import annotations

import atexit
import io
import os
import queue as queue_module
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankPool", "run_ranks"]


def _context(fn: Callable[..., Any]) -> Any:
    """The start method of the ranks: a fork server where the platform has one, else spawn.
    The server imports this package (torch, Dynamo, AOTAutograd, DTensor, the backend, the
    built-in family) and `fn`'s module once for every rank it starts."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # no effect once this process's server runs
    ctx.set_forkserver_preload(["dsv41_compile", fn.__module__])
    return ctx


def _enter(environ: dict[str, str]) -> None:
    """A rank's first step: the caller's environment (a fork server's child has the server's),
    one intra-op thread (8 ranks share the host's cores)."""
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)


def _join(rank: int, world_size: int, store_path: str, pg_timeout: float | None = None) -> None:
    """This rank's gloo process group; `pg_timeout` in seconds (torch's default otherwise)."""
    timeout: dict[str, Any] = (
        {} if pg_timeout is None else {"timeout": timedelta(seconds=pg_timeout)}
    )
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size, **timeout
    )


def _child(
    rank: int,
    world_size: int,
    store_path: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
    pg_timeout: float | None,
    environ: dict[str, str],
) -> None:
    _enter(environ)
    try:
        _join(rank, world_size, store_path, pg_timeout)
        _run_and_report(rank, world_size, fn, args, queue)
    except BaseException:  # report every failure to the parent, then exit
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_and_report(
    rank: int, world_size: int, fn: Callable[..., Any], args: tuple[Any, ...], queue: Any
) -> None:
    """`fn(rank, world_size, *args)`, its result or its traceback put on `queue`."""
    try:
        result = fn(rank, world_size, *args)
        # Serialised, not shared: the child may exit before the parent reads shared tensors.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def _more_failures(queue: Any, procs: list[Any], results: dict[int, Any]) -> dict[int, str]:
    """The reports (and silent deaths) of the other ranks within a few seconds of a failure."""
    more: dict[int, str] = {}
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            rank, ok, payload = queue.get(timeout=0.5)
        except queue_module.Empty:
            continue
        if not ok:
            more[rank] = payload
    for r, p in enumerate(procs):
        if r not in results and r not in more and p.exitcode not in (None, 0):
            more[r] = f"process exited with code {p.exitcode} (no report)"
    return more


def _pool_child(
    rank: int, world_size: int, store_path: str, tasks: Any, queue: Any, environ: dict[str, str]
) -> None:
    _enter(environ)
    _join(rank, world_size, store_path)
    try:
        while (task := tasks.get()) is not None:
            fn, args = task
            _clean_compile_state()
            _run_and_report(rank, world_size, fn, args, queue)
    finally:
        dist.destroy_process_group()


def _clean_compile_state() -> None:
    """What one run of a pool leaves that the next must not see."""

    from dsv41_compile.core.torch_private import dynamo_counters as counters
    from dsv41_compile.runtime.host_cache import STATS

    torch.compiler.reset()
    counters.clear()
    STATS.clear()


_SHARED: dict[int, RankPool] = {}


class RankPool:
    """`world_size` gloo processes started once and reused by `run`; a context manager."""

    def __init__(self, world_size: int, *, timeout: float = 1800.0) -> None:
        self.world_size, self.timeout = world_size, timeout
        self._procs: list[Any] = []

    def _start(self, fn: Callable[..., Any]) -> None:
        ctx = _context(fn)
        self._tmp = tempfile.TemporaryDirectory()
        store = os.path.join(self._tmp.name, "store")
        self._queue = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_pool_child,
                args=(r, self.world_size, store, q, self._queue, dict(os.environ)),
            )
            for r, q in enumerate(self._tasks)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`[fn(r, world_size, *args) for r in ranks]`, each on its rank's process."""
        if not self._procs:
            self._start(fn)
        for tasks in self._tasks:
            tasks.put((fn, args))
        try:
            return _collect(self._queue, self._procs, self.world_size, self.timeout, ())
        except BaseException:
            self.close()  # a rank may be stuck in a collective: start afresh next time
            raise

    def close(self) -> None:
        for tasks, p in zip(self._tasks, self._procs):
            if p.is_alive():
                tasks.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        if self._procs:
            self._tmp.cleanup()
        self._procs = []

    @classmethod
    def shared(cls, world_size: int) -> RankPool:
        """This process's pool of `world_size` ranks, closed when it exits."""
        if world_size not in _SHARED:
            _SHARED[world_size] = pool = cls(world_size)
            atexit.register(pool.close)
        return _SHARED[world_size]

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 1800.0,
    pg_timeout: float | None = None,
    may_exit: tuple[int, ...] = (),
) -> list[Any]:
    """`[fn(r, world_size, *args) for r in ranks]`, each in its own process on gloo.
    `pg_timeout`: the process group's timeout in seconds (torch's default otherwise); ranks in
    `may_exit` may end without a result (their entry is None), as a rank that dies does."""
    ctx = _context(fn)
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(r, world_size, store, fn, args, queue, pg_timeout, dict(os.environ)),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        done = False
        try:
            results = _collect(queue, procs, world_size, timeout, may_exit)
            done = True
            return results
        finally:
            for p in procs:
                p.join(timeout=timeout if done else 5)  # after a failure, peers may hang
                if p.is_alive():
                    p.kill()


def _collect(
    queue: Any, procs: list[Any], world_size: int, timeout: float, may_exit: tuple[int, ...]
) -> list[Any]:
    """Every rank's result from `queue`, or a RuntimeError with the failing ranks' reports."""
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world_size and not failures:
        try:
            rank, ok, payload = queue.get(timeout=1.0)
        except queue_module.Empty:
            # A child that died without reporting (a signal, an abort in the backend).
            for r, p in enumerate(procs):
                if r in may_exit and p.exitcode is not None and r not in results:
                    results[r] = None
                elif r not in results and p.exitcode not in (None, 0):
                    failures[r] = f"process exited with code {p.exitcode} (no report)"
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(results))} "
                    f"did not finish in {timeout} s"
                ) from None
            continue
        if ok:
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            failures[rank] = payload
            failures.update(_more_failures(queue, procs, results))
    if failures:
        # A rank's error often makes its peers fail in a collective; report them all, real
        # errors (tracebacks without "Connection reset") first.
        order = sorted(failures, key=lambda r: ("Connection reset" in failures[r], r))
        raise RuntimeError(
            "\n".join(f"rank {r} of {world_size} failed:\n{failures[r]}" for r in order)
        )
    return [results[r] for r in range(world_size)]
