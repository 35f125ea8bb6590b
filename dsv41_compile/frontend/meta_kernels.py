"""Meta kernels that trace the token count as an ordinary size, held while Dynamo compiles.

A token count that is a symbol must trace like an ordinary size. torch's meta kernels of
`roll`, `cummax` and `cummin` branch on `numel() == 0` before making a shape that does not
depend on it, which an unbacked T cannot decide: Dynamo would refuse the op under
`mark_token_dim`, and so would the generalization of a static graph (`frontend.tokens`). These
kernels make the same output shape, dtype and layout without the branch.

They replace torch's only while a compile runs: from the start of each Dynamo compile (before
it traces the frame) to its end (the backend's work included), and around the front porch's
trace (`size_oblivious_meta`). Outside a compile -- eager code, meta tensors, fake tensors of
other tools -- torch's kernels stand. Another backend's compile in the same process, while the
package is imported, sees them too: they differ from torch's in no result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from dsv41_compile.core.torch_private import on_dynamo_compiles, replace_meta_kernel

__all__ = ["SIZE_OBLIVIOUS_META", "hold_during_dynamo_compiles", "size_oblivious_meta"]

aten = torch.ops.aten


def _roll_meta(a: torch.Tensor, shifts: Any, dims: Any = ()) -> torch.Tensor:
    # torch._refs.roll returns early for numel() == 0 (a modulo by the size follows)
    return torch.empty_like(a, memory_format=torch.contiguous_format)


def _cummaxmin_meta(a: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    # torch's checks the dim only when numel() != 0; any valid dim gives the input's shape
    ndim = max(a.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(f"Dimension out of range (expected to be in [{-ndim}, {ndim - 1}])")
    values = torch.empty(a.shape, device=a.device, dtype=a.dtype)
    return values, torch.empty(a.shape, device=a.device, dtype=torch.int64)


SIZE_OBLIVIOUS_META = {
    aten.roll.default: _roll_meta,
    aten.cummax.default: _cummaxmin_meta,
    aten.cummin.default: _cummaxmin_meta,
}
"""The ops whose meta kernels a compile replaces (the module docstring)."""

_held = 0
_restore: list[Callable[[], None]] = []


def _enter() -> None:
    global _held
    _held += 1
    if _held == 1:
        _restore.extend(replace_meta_kernel(op, k) for op, k in SIZE_OBLIVIOUS_META.items())


def _exit() -> None:
    global _held
    if _held == 0:  # a compile that began before the hook was installed
        return
    _held -= 1
    if _held == 0:
        while _restore:
            _restore.pop()()


@contextmanager
def size_oblivious_meta() -> Iterator[None]:
    """Within the block (nested blocks and Dynamo's compiles share one replacement), the
    kernels of `SIZE_OBLIVIOUS_META` stand for torch's."""
    _enter()
    try:
        yield
    finally:
        _exit()


def _compile_started(_args: object) -> None:
    _enter()


def _compile_ended(_args: object) -> None:
    _exit()


def hold_during_dynamo_compiles() -> None:
    """Hold the replacement from the start to the end of every Dynamo compile. Asked by
    `mark_token_dim` (an unbacked token count reaches the kernels while Dynamo traces) and by
    the backend when it is registered; `torch._dynamo.reset()` forgets it, the next
    `mark_token_dim` asks again."""
    on_dynamo_compiles(_compile_started, _compile_ended)
