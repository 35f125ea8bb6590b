"""Selections by value whose scores tie within rounding, found while a model runs.

A model that selects by value -- `topk`, `argmax` / `argmin`, `max` / `min` along a dim,
`sort` / `argsort`, `kthvalue` -- picks the rows its scores rank first. Where two scores on
either side of what is kept differ by less than rounding, the pick is decided by their last
bits, and any program that computes the scores in another summation order -- a sharded one,
another compiler's, another device's -- may pick other rows: the outputs then differ by far
more than rounding although neither program is wrong. The L2 norm of an RMSNorm output with
unit weights is one such score: sqrt(D) for every row, up to rounding.

    with watch_selections() as ties:
        reference(*batch, cache)          # the single-device model
    for tie in ties:
        print(tie)   # topk at edits.py:512 (top_K = torch.topk(...)): scores 7.99999952 and
                     # 7.99999905 on either side of what it keeps differ by 4.8e-07, within ...

A tie is a pair of finite scores, one kept and one not (for a sort: any two neighbours), that
differ by at most `rtol * max(1, |a|, |b|)`, exact ties included: an exact tie of computed
scores is a near tie in another summation order. `rtol` defaults to 1e-5, the fp32 tolerance
the comparisons with the single-device model use. Padding rows filled with -inf never tie.
"""

from __future__ import annotations

import linecache
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["NearTie", "watch_selections"]

RTOL = 1e-5


@dataclass(frozen=True)
class NearTie:
    """A selection whose scores tie within `rtol` across what it keeps."""

    op: str
    """The selection, as called (`topk`, `argmax`, `sort`, ...)."""
    where: str
    """`path:line` of the call in the model's source (the innermost frame outside torch)."""
    code: str
    """That line of source."""
    kept: float
    dropped: float
    """The two scores that tie: one the selection keeps, one it does not (a sort's neighbours:
    the earlier and the later)."""

    @property
    def gap(self) -> float:
        return abs(self.kept - self.dropped)

    def __str__(self) -> str:
        return (
            f"{self.op} at {self.where} ({self.code}): scores {self.kept:.9g} and "
            f"{self.dropped:.9g} on either side of what it keeps differ by {self.gap:.2g}, "
            "within rounding: a program that sums in another order (sharded, compiled, on "
            "another device) may select other rows"
        )


def _boundaries(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple | None:
    """(scores, dim, positions of the boundary pairs in the scores sorted descending) of a
    selection call, or None when the call selects nothing by value (`max(x)` with no dim)."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or not (x.dtype.is_floating_point and x.numel()):
        return None
    rest = list(args[1:])

    def arg(i: int, key: str, default: Any) -> Any:
        return rest[i] if len(rest) > i else kwargs.get(key, default)

    if name == "topk":
        k, dim, largest = arg(0, "k", None), arg(1, "dim", -1), arg(2, "largest", True)
        return (x if largest else -x), dim, [int(k) - 1] if k else []
    if name in ("argmax", "argmin", "max", "min"):
        dim = arg(0, "dim", None)
        if dim is None or isinstance(dim, torch.Tensor):  # max(x), max(x, other)
            if name in ("max", "min"):
                return None
            x, dim = x.reshape(-1), 0
        return (x if name in ("argmax", "max") else -x), dim, [0]
    if name in ("sort", "argsort", "msort"):
        dim = 0 if name == "msort" else arg(0, "dim", -1)
        if isinstance(dim, bool):  # sort(x, stable, dim=...) overloads
            dim = kwargs.get("dim", -1)
        size = x.shape[dim] if x.dim() else 1
        return x, dim, list(range(size - 1))
    if name == "kthvalue":
        k, dim = int(arg(0, "k", 1)), arg(1, "dim", -1)
        size = x.shape[dim] if x.dim() else 1
        # ascending (-x descending): the k-th is kept, its neighbours on both sides are not
        return -x, dim, [i for i in (k - 2, k - 1) if 0 <= i < size - 1]
    return None


def _near_tie(x: torch.Tensor, dim: int, at: list[int], rtol: float) -> tuple[float, float] | None:
    """The closest pair (sorted[i], sorted[i + 1]) over the boundaries `at` of `x` sorted
    descending along `dim`, if it ties within `rtol`."""
    if x.dim() == 0:
        return None
    values = x.detach().double().movedim(dim, -1)
    n = values.shape[-1]
    at = [i for i in at if 0 <= i < n - 1]
    if not at:
        return None
    ranked = values.sort(dim=-1, descending=True).values
    a, b = ranked[..., at], ranked[..., [i + 1 for i in at]]
    finite = a.isfinite() & b.isfinite()
    scale = torch.maximum(a.abs(), b.abs()).clamp(min=1.0)
    tied = finite & ((a - b).abs() <= rtol * scale)
    if not bool(tied.any()):
        return None
    gap = torch.where(tied, (a - b).abs(), torch.inf)
    i = int(gap.reshape(-1).argmin())
    return float(a.reshape(-1)[i]), float(b.reshape(-1)[i])


_TORCH = os.path.dirname(torch.__file__)
_HERE = os.path.abspath(__file__)


def _caller() -> tuple[str, str]:
    """`path:line` and source of the innermost frame outside torch and this module."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path.startswith(_TORCH) or path == _HERE:
            continue
        code = linecache.getline(frame.filename, frame.lineno or 0).strip()
        return f"{frame.filename}:{frame.lineno}", code
    return "?", ""


_SELECTIONS = ("topk", "argmax", "argmin", "max", "min", "sort", "argsort", "msort", "kthvalue")


class _Watch(TorchFunctionMode):
    def __init__(self, found: list[NearTie], rtol: float) -> None:
        super().__init__()
        self.found, self.rtol = found, rtol

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _SELECTIONS:  # (the mode is off while it runs: no recursion)
            found = _boundaries(name, tuple(args), kwargs)
            tie = None if found is None else _near_tie(*found, rtol=self.rtol)
            if tie is not None:
                where, code = _caller()
                self.found.append(NearTie(name, where, code, *tie))
        return func(*args, **kwargs)


@contextmanager
def watch_selections(rtol: float = RTOL) -> Iterator[list[NearTie]]:
    """Within the context, every selection by value an eager model makes whose scores tie
    within `rtol` is appended to the yielded list (the module docstring). Eager code only: a
    compiled program's selections run inside its graph, unseen."""
    found: list[NearTie] = []
    with _Watch(found, rtol):
        yield found
