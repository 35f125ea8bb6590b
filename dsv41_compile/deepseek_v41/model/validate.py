"""Validation of a packed batch: its shapes and dtypes by the forward itself
(`check_batch_shapes`), its values against a KV cache on the host, before the forward
(`validate_batch`).

The forward checks only what a tensor's metadata says (no host read). Its values (ids in the
vocabulary, positions continuing the cache) are read on the host: callers (the demo, benchmarks,
serving loops) run `validate_batch` on each batch.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_false

from dsv41_compile.deepseek_v41.model.cache import KVCache

__all__ = ["check_batch_shapes", "refuse", "validate_batch"]


def check_batch_shapes(
    input_ids: Tensor, positions: Tensor, slots: Tensor, logit_rows: Tensor | None = None
) -> None:
    """Raise `ValueError` unless `input_ids`, `positions` and `slots` are 1-D int64 tensors of
    one length T, and `logit_rows` (if given) a 1-D integer tensor of at most T rows, naming the
    tensor or the lengths. Metadata only: the forward runs it first (`validate_batch` reads
    the rows' values).

    Under torch.compile it checks as on one device: Dynamo traces a dim or a dtype as a guard
    on the input, and a length compared with another as a guard too -- except a length
    `mark_token_dim` leaves unknown, whose comparison cannot be decided while Dynamo traces
    (`guard_or_false` skips it): the dsv41_sp backend then checks the batch it compiles for, and
    its program every call's, with this function. No loop: Dynamo cannot stop a trace inside
    one (`refuse`). Where two inputs are wrong, the first named is in the order input_ids,
    slots, positions, logit_rows."""
    # In the order the forward first reads them: Dynamo numbers the inputs' size symbols in the
    # order it meets them, which decides the input a view of T names in the graph -- the same
    # with the layers as compiled regions and without (tests/test_regions.py).
    _check_token_input("input_ids", input_ids, "[T] of packed tokens")
    _check_token_input("slots", slots, "[T] of packed tokens")
    _check_token_input("positions", positions, "[T] of packed tokens")
    if logit_rows is not None:
        _check_token_input("logit_rows", logit_rows, "[R] of row indices")
    n, n_positions, n_slots = input_ids.shape[0], positions.shape[0], slots.shape[0]
    if guard_or_false(n_positions != n) or guard_or_false(n_slots != n):
        refuse(
            "input_ids, positions and slots must have the same length T, got "
            f"input_ids={n}, positions={n_positions}, slots={n_slots}"
        )
    if logit_rows is not None and guard_or_false(logit_rows.shape[0] > n):
        refuse(
            f"logit_rows asks for {logit_rows.shape[0]} rows of a batch of T={n}: it holds row "
            "indices into the batch, at most T of them"
        )


def _check_token_input(name: str, tensor: Tensor, what: str) -> None:
    """1-D and integer; a token input int64 (the embedding takes any integer index, the
    forward's one-hot and cache writes only int64), `logit_rows` any integer dtype."""
    if tensor.dim() != 1:
        refuse(f"{name} must be a 1-D tensor {what}, got shape {tuple(tensor.shape)}")
    dtype = tensor.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        refuse(f"{name} must be an integer tensor, got {dtype}; convert it with .long()")
    if name != "logit_rows" and dtype != torch.int64:
        refuse(f"{name} must be int64, got {dtype}; convert it with .long()")


@torch.compiler.disable
def refuse(message: str) -> None:
    """Raise `ValueError(message)`, outside Dynamo's trace: how the forward refuses a call. A
    `raise` in the code Dynamo traces makes it run the forward eagerly from then on --
    uncompiled, unsharded, for every later batch (torch 2.13: "Skipping the function and
    falling back to eager"); a call of a disabled function ends the trace there instead (a
    graph break on the refused call's path only), and the error is the call's. (Under
    `torch.compile(..., fullgraph=True)` the graph break is Dynamo's error, naming this
    function.)"""
    raise ValueError(message)


def validate_batch(
    input_ids: Tensor,
    positions: Tensor,
    slots: Tensor,
    cache: KVCache,
    *,
    vocab_size: int,
    logit_rows: Tensor | None = None,
) -> None:
    """Raise `ValueError` unless `(input_ids, positions, slots)` is a valid batch for `cache`
    (and `logit_rows`, the rows whose logits the call returns, indices in `[0, T)`).

    A batch is T packed tokens: `input_ids`, `positions` and `slots` are 1-D int64 tensors of
    length T. `slots[t]` is the cache slot (request) of token t, in `0..cache.num_slots - 1`, or
    -1 for a padding row. A request's tokens form one contiguous run of the batch, their
    positions increase by exactly 1, and the run's first position equals the number of tokens
    the cache already holds for that slot (`cache.lengths[slot]`), so prefill, decode and
    multi-token decode all continue the cache.

    Padding rows (slot -1) are exempt from the continuity checks: their ids and positions are
    ignored by the model, and are only required to lie in `[0, vocab_size)` and
    `[0, cache.max_len)` so that indexing with them is safe. A padding row between two tokens of
    the same slot splits that request into two runs, which is an error.

    Every message names the offending token index and what to change.
    """
    check_batch_shapes(input_ids, positions, slots, logit_rows)
    for name, tensor in (("input_ids", input_ids), ("positions", positions), ("slots", slots)):
        if tensor.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {tensor.dtype}; convert it with .long()")
    if logit_rows is not None:
        outside = [i for i, row in enumerate(logit_rows.tolist()) if not 0 <= row < len(slots)]
        if outside:
            i = outside[0]
            raise ValueError(
                f"logit_rows[{i}] = {int(logit_rows[i])} is not a row of the batch: rows are "
                f"0..{len(slots) - 1}"
            )

    num_slots = cache.num_slots
    max_len = cache.max_len
    held = cache.lengths.tolist()
    ids_T = input_ids.tolist()
    pos_T = positions.tolist()
    slot_T = slots.tolist()

    finished_runs: dict[int, tuple[int, int]] = {}  # slot -> (first token, last token) of its run
    run_slot = -1  # slot of the run that the previous token belongs to; -1 = none
    run_start = 0
    for t, (tok, pos, slot) in enumerate(zip(ids_T, pos_T, slot_T)):
        if not -1 <= slot < num_slots:
            raise ValueError(
                f"token {t}: slot {slot} is out of range; use 0..{num_slots - 1} for a request "
                f"or -1 for a padding row"
            )
        if not 0 <= tok < vocab_size:
            raise ValueError(f"token {t}: input id {tok} is out of vocab [0, {vocab_size})")
        if pos < 0:
            raise ValueError(f"token {t}: position {pos} is negative")
        if pos >= max_len:
            raise ValueError(
                f"token {t}: position {pos} is beyond max_len {max_len} of the cache; "
                f"create the cache with a larger max_len"
            )

        if slot != -1 and slot == run_slot:
            if pos != pos_T[t - 1] + 1:
                raise ValueError(
                    f"token {t}: position {pos} of slot {slot} does not follow position "
                    f"{pos_T[t - 1]} of token {t - 1}; positions inside a request must increase "
                    f"by exactly 1"
                )
            continue

        if run_slot != -1:
            finished_runs[run_slot] = (run_start, t - 1)
        run_slot, run_start = slot, t
        if slot == -1:
            continue
        if slot in finished_runs:
            first, last = finished_runs[slot]
            raise ValueError(
                f"token {t}: slot {slot} starts a second run (its tokens {first}..{last} came "
                f"earlier); a request's tokens must be contiguous in the batch"
            )
        if pos != held[slot]:
            raise ValueError(
                f"token {t}: position {pos} does not continue the cache: slot {slot} holds "
                f"{held[slot]} tokens, so the next position must be {held[slot]}, got {pos}"
            )
