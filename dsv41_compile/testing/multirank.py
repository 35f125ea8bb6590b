"""Run a function on W real processes joined by a gloo process group (CPU), collect results.

    results = run_ranks(fn, 8, spec)   # fn(rank, world_size, spec) in each process

`fn` must be importable by module name (the children are spawned). The first failing rank's
traceback is re-raised in the caller.
"""

from __future__ import annotations

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

__all__ = ["run_ranks"]


def _child(
    rank: int,
    world_size: int,
    store_path: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
    pg_timeout: float | None,
) -> None:
    torch.set_num_threads(1)
    try:
        timeout = {} if pg_timeout is None else {"timeout": timedelta(seconds=pg_timeout)}
        dist.init_process_group(
            "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size, **timeout
        )
        result = fn(rank, world_size, *args)
        # Serialised, not shared: the child exits before the parent reads shared tensors.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # report every failure to the parent, then exit
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


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
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_child, args=(r, world_size, store, fn, args, queue, pg_timeout))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        try:
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
        finally:
            for p in procs:
                p.join(timeout=5 if failures else timeout)
                if p.is_alive():
                    p.kill()
    if failures:
        # A rank's error often makes its peers fail in a collective; report them all, real
        # errors (tracebacks without "Connection reset") first.
        order = sorted(failures, key=lambda r: ("Connection reset" in failures[r], r))
        raise RuntimeError(
            "\n".join(f"rank {r} of {world_size} failed:\n{failures[r]}" for r in order)
        )
    return [results[r] for r in range(world_size)]
