"""token_shifts: a shift of a token shard along the tokens is one op, placed on the shard.

Requires: annotate. Ensures: every shift of a token-sharded value along the token dim -- row t
gets row t - k, the |k| rows with no source get constant or given rows -- written as

    torch.cat([outside_k, x[:-k]])       torch.cat([x[k:], outside_k])      (a slice and a cat)
    F.pad(x, (..., k, 0))[:T]            F.pad(x, (..., 0, k))[k:]          (a pad and a slice)

is one `shift_tokens(x, k, outside)` node (`spmd.token_ops`), placed `(S(0), R) -> S(0)`, and
the graph is annotated again (the ops after it see a token shard where they saw a gathered
value). `localize` gives it its per-rank form: the shard after the k rows before it, which one
AllGather of k rows per rank brings, where the slice of the written form would gather the
whole value. A shift of a replicated value (every rank holds all T rows: attention's) is left
as written; `torch.roll` is one op already (its rule is `spmd.token_ops`').

As written, `torch.cat([outside_k, x[:-k]])` has k rows where T < k (the slice is empty); the
shift has T. The two agree wherever the model's own ops accept both (T >= k, and T = 0 with
k = 1, where the model broadcasts its one row against no row).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import cast

import torch
from torch.distributed.tensor import Shard
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.node import Argument

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.errors import as_node
from dsv41_compile.core.meta import OUT
from dsv41_compile.core.symbols import is_token_count
from dsv41_compile.core.torch_private import custom_op_overload
from dsv41_compile.spmd.annotate import annotate
from dsv41_compile.spmd.token_dims import shift_tokens

__all__ = ["token_shifts"]

aten = torch.ops.aten


def token_shifts(gm: GraphModule, *, ctx: CompileContext) -> None:
    graph = gm.graph
    shifted = False
    for node in list(graph.nodes):
        found = _cat_shift(node) or _pad_shift(node)
        if found is None:
            continue
        x, k, outside, written = found
        with graph.inserting_before(node):
            if not isinstance(outside, torch.fx.Node):
                outside = _constant_rows(graph, x, k, outside, ctx)
            shift = graph.call_function(custom_op_overload(shift_tokens), (x, k, outside))
        shift.meta["val"] = x.meta["val"]
        for key in ("stack_trace", "nn_module_stack"):
            if key in node.meta:
                shift.meta[key] = node.meta[key]
                outside.meta.setdefault(key, node.meta[key])
        node.replace_all_uses_with(shift)
        for dead in (node, *written):
            if not dead.users:
                graph.erase_node(dead)
        shifted = True
    if shifted:
        graph.lint()
        gm.recompile()
        annotate(gm, ctx=ctx)


def _token_shard(x: object) -> bool:
    if not isinstance(x, Node) or x.meta.get(OUT) != Shard(0):
        return False
    val = x.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() > 0 and is_token_count(val.shape[0])


def _equals(end: object, value: object) -> bool:
    """A slice bound equal to `value` (a size of the graph, or an int)."""
    end = end.meta.get("val") if isinstance(end, Node) else end
    if isinstance(end, int) and isinstance(value, int):
        return end == value
    return statically_known_true(end == value)  # no guard: a static T0 is not T


def _static_rows(node: object, like: Node) -> int | None:
    """Rows of `node` when it is a static block of rows shaped like `like`'s rows."""
    if not isinstance(node, Node) or _token_shard(node):
        return None
    val, x = node.meta.get("val"), like.meta["val"]
    if not isinstance(val, torch.Tensor) or val.dim() != x.dim() or val.dtype != x.dtype:
        return None
    rows = val.shape[0]
    same = all(statically_known_true(a == b) for a, b in zip(val.shape[1:], x.shape[1:]))
    return rows if isinstance(rows, int) and rows > 0 and same else None


def _slice_of(node: object) -> tuple[Node, object, object] | None:
    """(x, start, end) of `x[start:end]` along dim 0, step 1."""
    if not isinstance(node, Node) or node.target is not aten.slice.Tensor:
        return None
    args: tuple[Argument, ...] = (*node.args, *(() if len(node.args) > 4 else ()))
    x, dim, start, end, *step = args
    if dim != 0 or (step and step[0] != 1):
        return None
    return as_node(x, "a shift's argument"), start, end


def _cat_shift(node: Node) -> tuple[Node, int, Node, tuple[Node, ...]] | None:
    """`cat([outside, x[:-k]])` (k > 0) or `cat([x[k:], outside])` (k < 0)."""
    if node.target is not aten.cat.default:
        return None
    tensors = cast(Sequence[Node], node.args[0])
    if len(tensors) != 2:
        return None
    if (node.args[1] if len(node.args) > 1 else 0) != 0:
        return None
    first, second = tensors
    down = _slice_of(second)
    if down is not None and _token_shard(down[0]) and down[1] == 0:
        x, _, end = down
        k = _static_rows(first, x)
        if k is not None and (_equals(end, -k) or _equals(end, x.meta["val"].shape[0] - k)):
            return x, k, first, (second,)
    up = _slice_of(first)
    if up is not None and _token_shard(up[0]) and isinstance(up[1], int) and up[1] > 0:
        x, _, end = up
        k = up[1]
        if _static_rows(second, x) == k and (
            end == sys.maxsize or _equals(end, x.meta["val"].shape[0])
        ):
            return x, -k, second, (first,)
    return None


def _pad_shift(node: Node) -> tuple[Node, int, float, tuple[Node, ...]] | None:
    """`pad(x, (..., k, 0), value)[:T]` (k > 0) or `pad(x, (..., 0, k), value)[k:]` (k < 0)."""
    sliced = _slice_of(node)
    if sliced is None:
        return None
    padded, start, end = sliced
    if padded.target is not aten.constant_pad_nd.default or not _token_shard(padded.args[0]):
        return None
    x, pads = (
        as_node(padded.args[0], "a shift's argument"),
        list(cast(Sequence[int], padded.args[1])),
    )
    value = cast(float, padded.args[2] if len(padded.args) > 2 else 0.0)
    if len(pads) != 2 * x.meta["val"].dim() or any(pads[:-2]):
        return None
    before, after = pads[-2:]
    T = x.meta["val"].shape[0]
    if before > 0 and after == 0 and start == 0 and (_equals(end, -before) or _equals(end, T)):
        return x, before, value, (padded,)
    up = before == 0 and after > 0 and start == after
    if up and (end == sys.maxsize or _equals(end, T + after)):
        return x, -after, value, (padded,)
    return None


def _constant_rows(
    graph: torch.fx.Graph, x: Node, k: int, value: float, ctx: CompileContext
) -> Node:
    """A `[|k|, ...]` block of `value` shaped like `x`'s rows: a pad's outside rows."""
    val = x.meta["val"]
    shape = [abs(k), *val.shape[1:]]
    rows = graph.call_function(
        aten.full.default, (shape, value), {"dtype": val.dtype, "device": val.device}
    )
    with ctx.fake_mode:
        rows.meta["val"] = torch.full(shape, value, dtype=val.dtype, device=val.device)
    return rows
