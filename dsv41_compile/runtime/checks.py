"""Checks the runtime makes around a call: that the ranks of a TP group were given the same
batch (the `check_inputs` option), and what a failed collective means."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["check_same_inputs", "collective_failure"]

_NO_VALUE = -(2**62)
"""Fills the rows a shorter batch does not have (never an id, a position or a slot)."""


def check_same_inputs(
    inputs: Sequence[torch.Tensor], names: Sequence[str], group: dist.ProcessGroup, group_index: int
) -> None:
    """Raise a ValueError unless every rank of `group` holds the same `inputs` (1-D int64 of
    the same length T): two all-gathers over the group and a host read. Every rank reaches the
    same verdict, so all of them raise the same error."""
    ranks = dist.get_process_group_ranks(group)
    stacked = torch.stack([x.reshape(-1) for x in inputs])  # [inputs, T]
    count = torch.tensor([stacked.shape[1]], dtype=torch.int64)
    counts = [torch.empty_like(count) for _ in ranks]
    dist.all_gather(counts, count, group=group)
    longest = max(int(c) for c in counts)
    padded = torch.full((len(inputs), longest), _NO_VALUE, dtype=torch.int64)
    padded[:, : stacked.shape[1]] = stacked
    gathered = [torch.empty_like(padded) for _ in ranks]
    dist.all_gather(gathered, padded, group=group)
    first = gathered[0]
    for rank, batch in zip(ranks[1:], gathered[1:]):
        differs = (batch != first).any(0).nonzero()
        if not len(differs):
            continue
        row = int(differs[0])
        which = next(i for i in range(len(inputs)) if batch[i, row] != first[i, row])
        ours, theirs = (_shown(int(t[which, row])) for t in (first, batch))
        raise ValueError(
            f"check_inputs: the ranks of TP group {group_index} were given different batches: "
            f"rank {ranks[0]} has {int(counts[0])} tokens and rank {rank} "
            f"{int(counts[ranks.index(rank)])}; they differ first at token {row}, where "
            f"{names[which]} is {ours} on rank {ranks[0]} and {theirs} on rank {rank}. Every rank of a TP group must be called with its DP group's whole batch "
            f"(the same {', '.join(names)})"
        )


def _shown(value: int) -> str:
    return "no row" if value == _NO_VALUE else str(value)


def collective_failure(error: BaseException, rank: int, call: int) -> RuntimeError | None:
    """A clearer error for a collective that failed because a peer rank is gone, or None when
    `error` is not one."""
    text = str(error)
    markers = ("Connection closed", "Connection reset", "Timed out", "timed out", "Broken pipe")
    if not isinstance(error, dist.DistError) and not any(m in text for m in markers):
        return None
    return RuntimeError(
        f"dsv41_sp: rank {rank}'s program failed in a collective at call {call}: a peer rank "
        "died, hung, or stopped calling the compiled model (a rank waits at most the process "
        "group's timeout, init_process_group(timeout=...)). The collective's error: "
        f"{text.splitlines()[0] if text else type(error).__name__}"
    )
