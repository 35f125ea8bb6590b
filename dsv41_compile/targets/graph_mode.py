"""graph_mode: the per-rank graph in ops torchair converts to GE (`lowering="torchair"` only).

Requires: expert_parallel (with `ep > 1`, padded dispatch: static sizes, no host reads).
Ensures: every node is an op with a real GE converter in torch-npu 2.13.0's torchair, or one its
own AOT step decomposes (`_c10d_functional.all_to_all_single`) -- `tools/torchair_coverage.py`
checks this against torchair's source. Each rewrite computes the same values as the op it
replaces (`tests/targets/test_graph_mode.py`; whole graphs, run on CPU through
`testing.torchair_standin`, in tests/distributed/test_numerics.py). The ATen ops:

    softplus(x, b, t)             where(x*b > t, x, log1p(exp(x*b)) / b)  (ATen's formula)
    where(c, x, scalar)           where(c, x, scalar_tensor(scalar))
    index_put(a, [i], v)          scatter(a, 0, i expanded to v, v)       (i modulo a's rows)
    index_put(a, [i, j], v)       the same on a viewed as [a0*a1, ...], row i*a1 + j
    scatter_reduce(a, 0, i, v, "amax"|"amin", include_self)
                                  max|min over the rows of where(one_hot(i), v, a), with a
    unflatten(x, d, sizes)        view(x, shape)
    bitwise_xor(a, b)             (a | b) & ~(a & b)
    copysign(a, b)                where(1/b < 0, -|a|, |a|)
    amax(x, dims)                 max over one dim at a time
    roll(x, s, d)                 cat(x[-s:], x[:-s]) along d   (|s| = 1 when d's size is symbolic)
    _assert_scalar, _assert_async, runtime asserts of symbolic sizes the graph guarantees by
    sym_constrain_range_for_size  construction; dropped with the symbolic arithmetic only
                                  they used (torchair has no converter for them)

A model's custom ops are rewritten by its adapter's `graph_mode_rewrites` (DeepSeek V4.1's
routed experts through torch_npu's grouped matmul: `models/deepseek_v41/graph_mode.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node, Proxy
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.emitter import Emitter
from dsv41_compile.core.meta import replace_node
from dsv41_compile.core.torch_private import enable_python_dispatcher

__all__ = ["graph_mode", "rewrite_for_graph_mode"]

aten = torch.ops.aten
DROPPED = (
    aten._assert_scalar.default,
    aten._assert_async.default,
    aten._assert_async.msg,
    aten.sym_constrain_range_for_size.default,
)


def graph_mode(gm: GraphModule, *, ctx: CompileContext) -> None:
    # Local values for every node (expert_parallel's nodes have none yet): the rewrites read
    # shapes and dtypes.
    with enable_python_dispatcher():  # the decompositions that take symbolic sizes
        FakeTensorProp(gm, mode=ctx.fake_mode).propagate_dont_convert_inputs(*ctx.local_inputs(gm))
    rewrite_for_graph_mode(gm, ctx.adapter.graph_mode_rewrites)


def rewrite_for_graph_mode(
    gm: GraphModule, model_rewrites: Mapping[Any, Any] | None = None
) -> None:
    """The rewrites of the table above and `model_rewrites` (op -> rewrite), on a graph whose
    nodes carry `meta["val"]`."""
    rewrites = {**_REWRITES, **(model_rewrites or {})}
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in DROPPED:
            graph.erase_node(node)
            continue
        rewrite = rewrites.get(node.target)
        if rewrite is not None:
            _replace(graph, node, rewrite)
    graph.eliminate_dead_code()  # the symbolic arithmetic only the asserts read
    graph.lint()
    gm.recompile()


def _replace(graph: Graph, node: Node, rewrite: Callable[..., Proxy]) -> None:
    emit = Emitter(graph)
    with emit.inserting_before(node) as added:
        out = rewrite(emit, node.meta["val"], *emit.proxy(node.args), **emit.proxy(node.kwargs))
    replace_node(node, out.node, added, f"graph mode: {node.target} has no torchair converter")


def _softplus(emit, val, x, beta=1, threshold=20):
    xb = x if beta == 1 else aten.mul.Scalar(x, beta)
    soft = aten.log1p.default(aten.exp.default(xb))
    if beta != 1:
        soft = aten.div.Scalar(soft, beta)
    return aten.where.self(aten.gt.Scalar(xb, threshold), x, soft)


def _where_scalar_other(emit, val, condition, x, other):
    scalar = emit.call(aten.scalar_tensor.default, other, dtype=val.dtype, device=val.device)
    return aten.where.self(condition, x, scalar)


def _index_put(emit, val, a, indices, values, accumulate=False):
    if accumulate or not 1 <= len(indices) <= 2 or any(i is None for i in indices):
        raise ValueError(
            f"graph_mode rewrites index_put with one or two index tensors and no accumulate; "
            f"got {len(indices)} indices (accumulate={accumulate}). Write the update as a "
            "scatter, or extend graph_mode"
        )
    shape = list(val.shape)
    rows = shape[0] if isinstance(shape[0], int) else aten.sym_size.int(a, 0)
    index = aten.remainder.Scalar(indices[0], rows)  # index_put wraps negative indices
    target = a
    if len(indices) == 2:
        cols = int(shape[1])
        index = aten.add.Tensor(
            aten.mul.Tensor(index, cols), aten.remainder.Scalar(indices[1], cols)
        )
        flat = shape[0] * cols if isinstance(shape[0], int) else -1
        target = aten.view.default(a, [flat, *_view_shape(val)[2:]])
    trailing = len(shape) - len(indices)
    index = aten.view.default(index, [-1] + [1] * trailing)
    index = aten.expand.default(index, [-1, *shape[len(indices) :]])
    out = aten.scatter.src(target, 0, index, values)
    return out if len(indices) == 1 else aten.view.default(out, _view_shape(val))


def _scatter_reduce(emit, val, a, dim, index, src, reduce, *, include_self=True):
    ndim = a.node.meta["val"].dim()
    if dim != 0 or ndim != 1 or reduce not in ("amax", "amin") or not include_self:
        raise ValueError(
            "graph_mode rewrites 1-D scatter_reduce with amax / amin and include_self; got "
            f"dim={dim}, reduce={reduce!r}, include_self={include_self} on {ndim}-D. Extend "
            "graph_mode"
        )
    size = val.shape[0]
    slots = emit.call(
        aten.arange.default, size, dtype=index.node.meta["val"].dtype, device=val.device
    )
    hit = aten.eq.Tensor(aten.unsqueeze.default(index, 1), aten.unsqueeze.default(slots, 0))
    keep = aten.unsqueeze.default(a, 0)  # rows that miss a slot leave it as it is
    candidates = aten.where.self(hit, aten.unsqueeze.default(src, 1), keep)  # [N, size]
    candidates = aten.cat.default([keep, candidates])  # a's own row: also when N = 0
    pick = aten.max.dim if reduce == "amax" else aten.min.dim
    return pick(candidates, 0)[0]


def _amax(emit, val, x, dim=(), keepdim=False):
    ndim = x.node.meta["val"].dim()
    dims = sorted({d % ndim for d in dim} if dim else range(ndim), reverse=True)
    for d in dims:  # one dim at a time, last first: the others keep their positions
        x = aten.max.dim(x, d, keepdim)[0]
    return x


def _roll(emit, val, x, shifts, dims=()):
    if not dims and x.node.meta["val"].dim() == 1:
        dims = [0]
    if len(shifts) != 1 or len(dims) != 1:
        raise ValueError(
            f"graph_mode rewrites roll along one dim; got shifts={shifts}, dims={dims}"
        )
    (shift,), (dim,) = shifts, dims
    size = val.shape[dim]
    if isinstance(size, int):
        shift %= max(size, 1)
    elif abs(shift) != 1:  # a symbolic size may be smaller than the shift
        raise ValueError(f"graph_mode rolls a dim of symbolic size by +-1 only, got {shift}")
    if shift == 0:
        return aten.clone.default(x)
    # roll(x, s)[i] = x[i - s]: the last s entries, then the others
    tail = aten.slice.Tensor(x, dim, -shift, _END)
    head = aten.slice.Tensor(x, dim, 0, -shift)
    return aten.cat.default([tail, head], dim)


_END = 2**63 - 1
"""A slice's `end` meaning "to the end" (what ATen records for `x[a:]`)."""


def _bitwise_xor(emit, val, a, b):
    """`a ^ b` of integers as `(a | b) & ~(a & b)`."""
    both = aten.bitwise_and.Tensor(a, b)
    return aten.bitwise_and.Tensor(aten.bitwise_or.Tensor(a, b), aten.bitwise_not.default(both))


def _copysign(emit, val, a, b):
    """`|a|` with the sign of `b`, the sign read as `1/b < 0` (which tells -0.0 from 0.0)."""
    magnitude = aten.abs.default(a)
    negative = aten.lt.Scalar(aten.reciprocal.default(b), 0)
    return aten.where.self(negative, aten.neg.default(magnitude), magnitude)


def _unflatten(emit, val, x, dim, sizes):
    return aten.view.default(x, _view_shape(val))


def _view_shape(val: torch.Tensor) -> list[Any]:
    """`val`'s shape as view arguments: its one symbolic size (the token count) as -1."""
    symbolic = [i for i, s in enumerate(val.shape) if isinstance(s, torch.SymInt)]
    if len(symbolic) > 1:
        raise ValueError(
            f"graph_mode views with one symbolic size; {list(val.shape)} has {len(symbolic)}"
        )
    return [-1 if isinstance(s, torch.SymInt) else int(s) for s in val.shape]


_REWRITES: dict[Any, Callable[..., Proxy]] = {
    aten.softplus.default: _softplus,
    aten.where.ScalarOther: _where_scalar_other,
    aten.index_put.default: _index_put,
    aten.scatter_reduce.two: _scatter_reduce,
    aten.unflatten.int: _unflatten,
    aten.amax.default: _amax,
    aten.roll.default: _roll,
    aten.bitwise_xor.Tensor: _bitwise_xor,
    aten.copysign.Tensor: _copysign,
}
