"""Batches for tests and tools: `Request` and `pack` (the model's packed-batch form), and
schedules that feed prompts through a cache."""

from __future__ import annotations

from collections.abc import Sequence

from dsv41_compile.deepseek_v41.model.batches import Request, pack

__all__ = ["Request", "incremental_schedule", "pack"]


def incremental_schedule(
    prompts: Sequence[Sequence[int]], prefill: Sequence[int], step: int
) -> list[list[Request]]:
    """Batches that feed `prompts` (request i in slot i) through a cache: first a packed
    prefill of `prefill[i]` tokens each, then calls that append up to `step` tokens per
    unfinished request (1: decode; k > 1: multi-token decode, as in DSpark verification)."""
    done = list(prefill)
    batches = [[Request(s, p[:n]) for s, (p, n) in enumerate(zip(prompts, done)) if n]]
    while any(n < len(p) for n, p in zip(done, prompts)):
        batches.append(
            [
                Request(s, p[n : n + step], start=n)
                for s, (p, n) in enumerate(zip(prompts, done))
                if n < len(p)
            ]
        )
        done = [min(n + step, len(p)) for n, p in zip(done, prompts)]
    return batches
