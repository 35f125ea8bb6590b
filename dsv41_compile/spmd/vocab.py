"""Vocabulary sharding of a `[V, D]` weight over tp, for any family that opts into it: an
embedding table or an output head held whole on every rank ("replicated") or with its V rows
split over tp ("vocab_sharded"). Nothing here knows a family: the family names its weights
and its options, puts `vocab_entries` in its plan and, for a head chosen by time, calls
`head_choice` from its adapter's `resolve`.

The op rules do the rest (`spmd.rules`): a lookup into a vocab-sharded table reads its own
rows and sums the partial rows over tp; a head's matmul with vocab-sharded rows gives `[R, V/tp]`
logits, gathered where the graph returns them.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from dsv41_compile.core.plan import Entry
from dsv41_compile.devices import timed_choice
from dsv41_compile.options import BackendOptions

__all__ = ["VOCAB_HOLDINGS", "head_choice", "vocab_entries"]

VOCAB_HOLDINGS = ("replicated", "vocab_sharded")
"""How a `[V, D]` weight is held over tp."""


def vocab_entries(fqn: str, holding: str) -> tuple[Entry, ...]:
    """The plan's entry for the `[V, D]` weight `fqn` held `holding` (none when replicated: an
    unlisted parameter is)."""
    if holding not in VOCAB_HOLDINGS:
        raise ValueError(f"{fqn}: {holding!r} is not one of {VOCAB_HOLDINGS}")
    return (Entry(fqn, Shard(0)),) if holding == "vocab_sharded" else ()


def head_choice(
    option: str, given: str, head: torch.Tensor | None, options: BackendOptions
) -> tuple[str, dict[str, str]]:
    """How the head `[V, D]` is held ("replicated" or "vocab_sharded") when the family's option
    `option` says `given` ("auto", or one of them), and why, keyed by `option` (empty when
    there was nothing to choose). "auto" chooses by the time the head adds to a step on the
    device model at `rows_per_step` rows (the rows asked for): each the roofline of its matmul
    (the head's bytes read, 2*R*V*D FLOPs at the device's bf16 rate), and the sharded head one
    AllGather of the `[R, V/tp]` fp32 logits: a latency and (tp-1)/tp of R*V*4 bytes leaving
    the rank. A model without a head, or tp=1, holds it replicated."""
    if head is None or options.tp == 1:
        if given == "vocab_sharded" and head is not None:
            raise ValueError(
                f"{option}='vocab_sharded' splits the head over tp; with tp=1 use 'auto'"
            )
        return "replicated", {}
    tp, (vocab, dim) = options.tp, head.shape
    if vocab % tp:
        if given == "vocab_sharded":
            raise ValueError(
                f"{option}='vocab_sharded': tp={tp} does not divide the vocabulary ({vocab} "
                f"rows); use {option}='replicated' or a tp that divides it"
            )
        return "replicated", {
            option: f"{option}={given!r}: replicated (tp={tp} does not divide V={vocab})"
        }
    device = options.device_model(head.device.type)
    rows = options.rows_per_step
    weight = head.numel() * head.element_size()

    def matmul(share: int) -> float:
        return device.roofline_seconds(weight / share, 2 * rows * vocab * dim / share)

    gather = rows * vocab * 4
    seconds = {
        "replicated": matmul(1),
        "vocab_sharded": matmul(tp) + device.collective_seconds((tp - 1) / tp * gather, group=tp),
    }
    chosen = min(seconds, key=seconds.__getitem__) if given == "auto" else given
    why = timed_choice(option, given, chosen, seconds, "step", 1, device.name, rows) + (
        f" (the head {weight:,} B; sharded: {weight // tp:,} B per rank and an AllGather of "
        f"{gather // tp:,} B per rank)"
    )
    return chosen, {option: why}
