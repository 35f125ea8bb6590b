"""Serving faults on real ranks, for the multi-rank tests: a TP rank handed another batch, a
rank that dies, a rank that hangs. Each function runs on one rank (`testing.multirank`) and
returns what that rank saw -- the error and how long it took to come -- instead of raising."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

import dsv41_compile
from dsv41_compile.deepseek_v41.model import DeepseekV41
from dsv41_compile.deepseek_v41.model.validate import validate_batch
from dsv41_compile.deepseek_v41.testing.batches import Request, pack
from dsv41_compile.deepseek_v41.testing.presets import ONE_LAYER, compile_config

__all__ = ["FIRST", "different_batch_on_one_rank", "peer_lost"]

FIRST = (Request(0, [1, 2, 3], 0), Request(1, [4, 5], 0), Request(2, [6, 7, 8], 0))
"""Every DP group's first batch."""
SECOND = (Request(0, [9], 3), Request(1, [10, 11], 2))
"""Every DP group's second batch: a decode and a multi-token decode."""


def _compiled(options: dict[str, Any]) -> tuple[DeepseekV41, Any]:
    torch.manual_seed(0)
    # one window-only layer, 3 Sinkhorn iterations: what fails here is a rank, not the model
    model = DeepseekV41(compile_config("tiny-swa", ONE_LAYER))
    options = {"lowering": "eager", **options}
    return model, torch.compile(model, backend="dsv41_sp", options=options)


def _call(compiled: Any, batch: tuple, cache: Any) -> torch.Tensor:
    ids, positions, slots = batch
    dsv41_compile.mark_token_dim(ids, positions, slots)
    return compiled(ids, positions, slots, cache)


def different_batch_on_one_rank(rank: int, world_size: int, odd_rank: int) -> dict[str, Any]:
    """The ranks run the first batch with `check_inputs`; then `odd_rank` gets the second batch
    with one position changed (row 1). Returns this rank's error of the second call, and what
    `validate_batch` says of the second batch against the compiled model's cache."""
    model, compiled = _compiled({"tp": 4, "check_inputs": True})
    cache = model.new_cache(4, 32)
    _call(compiled, pack(FIRST), cache)
    second = pack(SECOND)
    validate_batch(*second, cache, vocab_size=model.cfg.vocab_size)  # continues the cache
    stale = None
    try:
        validate_batch(*pack(FIRST), cache, vocab_size=model.cfg.vocab_size)
    except ValueError as error:  # the first batch again: it no longer continues the cache
        stale = str(error)
    ids, positions, slots = second
    if rank == odd_rank:
        positions = positions.clone()
        positions[1] = 7
    try:
        _call(compiled, (ids, positions, slots), cache)
        seen = None
    except ValueError as error:
        seen = str(error)
    return {"error": seen, "stale": stale}


def peer_lost(rank: int, world_size: int, lost: int, hang: float, tp: int) -> dict[str, Any] | None:
    """Every rank runs the first batch (TP groups of `tp` ranks, experts over the world); then
    rank `lost` stops calling the model -- it hangs for `hang` seconds (0: it does not) and its
    process exits -- while the others call it with the second batch. Returns this rank's error
    and the seconds it took to come."""
    model, compiled = _compiled({"tp": tp, "ep": world_size})
    cache = model.new_cache(4, 32)
    _call(compiled, pack(FIRST), cache)
    torch.distributed.barrier()
    if rank == lost:
        time.sleep(hang)
        os._exit(1)
    start = time.perf_counter()
    try:
        _call(compiled, pack(SECOND), cache)
        seen = None
    except RuntimeError as error:
        seen = str(error)
    return {"error": seen, "seconds": time.perf_counter() - start}
