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
    cummax(x, d).values           a running max in log2(n) steps: max(x, x shifted by 1, 2, 4...)
                                  along d; along a symbolic last dim, the max over j <= i of
                                  x[..., j] (an error when the indices are read)
    frexp(x) of fp32              exponent and mantissa from x's bits (subnormals scaled by 2^64
                                  first); exact for finite x, zero gives (0, 0)
    ldexp(x, e) of fp32           x * 2^floor(e/2) * 2^(e - floor(e/2)), each power made from its
                                  bits: exact where the result is (e in [-150, 128] for x = 1)
    signbit(x)                    x's bits as an integer of its width, < 0
    x << s (a Scalar shift)       x * 2^s in x's integer dtype (the same bits, wrapping alike)
    roll(x, s, d)                 cat(x[-s:], x[:-s]) along d   (|s| = 1 when d's size is symbolic)
    _assert_scalar, _assert_async, runtime asserts of symbolic sizes the graph guarantees by
    sym_constrain_range_for_size  construction; dropped with the symbolic arithmetic only
                                  they used (torchair has no converter for them)

A model's custom ops are rewritten by its adapter's `graph_mode_rewrites` (DeepSeek V4.1's
routed experts through torch_npu's grouped matmul, its FP8 / FP4 weights and activation
quantisation through torch_npu's MX ops: `deepseek_v41/graph_mode.py`). A rewrite may
return None: the node stays as it is (a rewrite of a common op that applies to some of its
nodes only). The nodes a rewrite adds get values, which a later rewrite may read.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.fx import Graph, GraphModule, Node, Proxy

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.emitter import Emitter
from dsv41_compile.core.fake_prop import propagate_local_values
from dsv41_compile.core.meta import replace_node
from dsv41_compile.core.torch_private import (
    FakeTensorMode,
    detect_fake_mode,
    enable_python_dispatcher,
)
from dsv41_compile.options import BackendOptions
from dsv41_compile.runtime.program import PREPARATIONS
from dsv41_compile.targets.npu_dtypes import E2M1

__all__ = [
    "NPU_KERNEL_GAPS",
    "NZ_FP4",
    "graph_mode",
    "npu_ops",
    "prepare_fp4_weights",
    "rewrite_for_graph_mode",
]

aten = torch.ops.aten
DROPPED = (
    aten._assert_scalar.default,
    aten._assert_async.default,
    aten._assert_async.msg,
    aten.sym_constrain_range_for_size.default,
)


@dataclass(frozen=True)
class Lowered:
    """What a family's rewrite may ask of the compile it rewrites for (`lowering_now`): the
    lowering, the device the program is meant for (`BackendOptions.device_model`) and the rows
    per step its workload states (`BackendOptions.rows_per_step`)."""

    target: str
    device: str
    rows: int = BackendOptions.rows_per_step


_LOWERED: ContextVar[Lowered | None] = ContextVar("dsv41_lowered", default=None)


def lowering_now() -> Lowered | None:
    """The lowering and device of the rewrite running now; None outside the NPU passes."""
    return _LOWERED.get()


@contextmanager
def _lowering(ctx: CompileContext) -> Iterator[None]:
    device = ctx.options.device_model(ctx.mesh.device_type).name
    token = _LOWERED.set(Lowered(ctx.target, device, ctx.options.rows_per_step))
    try:
        yield
    finally:
        _LOWERED.reset(token)


GE_MX_A8W4_DEVICES = ("950dt", "950pr")
"""The devices whose GE graphs take `npu_grouped_matmul` in its MX A8W4 form (FP8 rows, FP4
weights as released): torchair's converter (torch-npu 2.13.0) maps that form on the 950's
architecture only."""


def ge_refuses_mx_a8w4(groups: int, ks: Sequence[int]) -> str | None:
    """Why torchair's GE converter of the MX A8W4 grouped matmul would refuse it here, or None:
    another device than a 950, or (its own refusals) one group of weights, or a contraction of
    64 (K = 64: the packed weight's 32 rows). Only for `lowering="torchair"`; npugraph_ex runs
    torch_npu's kernels, which take these."""
    lowered = lowering_now()
    if lowered is None or lowered.target != "torchair":
        return None
    if lowered.device not in GE_MX_A8W4_DEVICES:
        return f"torchair's GE maps the MX A8W4 grouped matmul on {GE_MX_A8W4_DEVICES} only"
    if groups == 1:
        return "torchair's GE refuses the MX A8W4 grouped matmul of one group of weights"
    if 64 in ks:
        return "torchair's GE refuses the MX A8W4 grouped matmul with K = 64"
    return None


def graph_mode(gm: GraphModule, *, ctx: CompileContext) -> None:
    # Local values for every node (expert_parallel's nodes have none yet): the rewrites read
    # shapes and dtypes.
    propagate_local_values(gm, ctx)
    with _lowering(ctx):
        rewrite_for_graph_mode(gm, ctx.adapter.graph_mode_rewrites)
    prepare_fp4_weights(gm, ctx)


def npu_ops(gm: GraphModule, *, ctx: CompileContext) -> None:
    """The model's own rewrites (`lowering="npugraph_ex"`): its custom ops as torch_npu's
    kernels; the rewrites above of the ATen ops torch_npu has no kernel for
    (`NPU_KERNEL_GAPS`: `frexp`, `copysign`); and the runtime asserts of sizes dropped
    (`_assert_async` has no NPU kernel either). The other ATen rewrites stand in for GE
    converters torchair lacks; npugraph_ex runs torch_npu's kernels, which the ops they
    replace have (`tools/torchair_coverage.py --lowering npugraph_ex`)."""
    propagate_local_values(gm, ctx)
    gaps = {op: _REWRITES[op] for op in NPU_KERNEL_GAPS}
    rewrites = {**gaps, **ctx.adapter.graph_mode_rewrites}
    why = "npugraph_ex: {op} as ops torch_npu has NPU kernels for"
    with _lowering(ctx):
        rewrite_for_graph_mode(gm, rewrites, aten_rewrites=False, why=why)
    prepare_fp4_weights(gm, ctx)


NZ_FP4 = "npu_nz_fp4"
"""The preparation of an FP4 weight the grouped matmul reads in its MX A8W4 form: torch_npu's
NZ layout (`npu_format_cast(w, 29, customize_dtype=float8_e4m3fn,
input_dtype=float4_e2m1fn_x2)`: the same bytes in the kernel's blocked order; the values, the
shape and the dtype unchanged)."""


def _nz_fp4(weight: torch.Tensor) -> torch.Tensor:
    """`NZ_FP4`: on an NPU, torch_npu's format cast of the FP4 bytes [E, N, K/2]; elsewhere
    (the CPU stand-ins) the tensor as it is -- a layout, which a CPU kernel reads as any other
    strided tensor."""
    torch_npu = sys.modules.get("torch_npu")
    if torch_npu is None or weight.device.type != "npu":
        return weight
    return torch_npu.npu_format_cast(
        weight, 29, customize_dtype=torch.float8_e4m3fn, input_dtype=torch_npu.float4_e2m1fn_x2
    )


PREPARATIONS.add(NZ_FP4, _nz_fp4)


def prepare_fp4_weights(gm: GraphModule, ctx: CompileContext) -> None:
    """Mark each weight a grouped matmul reads as FP4 (`weight_dtype` float4_e2m1) in the
    program's signature: the runtime holds it in the kernel's NZ layout, made once when it takes
    the shard (`NZ_FP4`), not on every call."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.kwargs.get("weight_dtype") != E2M1:
            continue
        weights = cast(list[Node], node.args[1])
        for weight in weights:
            source = weight
            while source.op == "call_function" and source.all_input_nodes:
                source = source.all_input_nodes[0]  # through its views (dtype, transpose)
            if source.op == "placeholder" and ctx.signature is not None:
                index = placeholders.index(source)
                ctx.signature = ctx.signature.with_preparation(index, NZ_FP4)


def rewrite_for_graph_mode(
    gm: GraphModule,
    model_rewrites: Mapping[Any, Any] | None = None,
    *,
    aten_rewrites: bool = True,
    why: str = "graph mode: {op} has no torchair converter",
) -> None:
    """The rewrites of the table above (with `aten_rewrites`; the asserts are dropped either
    way) and `model_rewrites` (op -> rewrite), on a graph whose nodes carry `meta["val"]`. The
    nodes a rewrite adds get their values too (fake tensors, in the graph's fake mode), so that
    a later rewrite reads the shapes of an earlier one's output; and `why` (with the op) as
    their reason."""
    rewrites = {**(_REWRITES if aten_rewrites else {}), **(model_rewrites or {})}
    graph = gm.graph
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes])
    for node in list(graph.nodes):
        if node.op != "call_function" or node.graph is not graph:  # erased by a rewrite
            continue
        if node.target in DROPPED:
            graph.erase_node(node)
            continue
        rewrite = rewrites.get(node.target)
        if rewrite is not None:
            _replace(graph, node, rewrite, fake_mode, why)
    graph.eliminate_dead_code()  # the symbolic arithmetic only the asserts read
    graph.lint()
    gm.recompile()


def _replace(
    graph: Graph,
    node: Node,
    rewrite: Callable[..., Proxy | tuple[Proxy | None, ...] | None],
    fake_mode: FakeTensorMode | None,
    why: str,
) -> None:
    emit = Emitter(graph)
    with emit.inserting_before(node) as added:
        out = rewrite(emit, node.meta["val"], *emit.proxy(node.args), **emit.proxy(node.kwargs))
    if out is None:  # the rewrite leaves this node as it is
        for new in reversed(added):
            graph.erase_node(new)
        return
    if fake_mode is not None:
        _values(added, fake_mode)
    reason = why.format(op=node.target)
    if not isinstance(out, tuple):
        replace_node(node, out.node, added, reason)
        return
    # an op of several outputs: each getitem of it takes the rewrite's output of its index
    made = [i for i, part in enumerate(out) if part is not None]
    for user in list(node.users):
        index = user.args[1] if user.target is operator.getitem else None
        if index is not None and not user.users:  # an output nothing reads
            graph.erase_node(user)
            continue
        if index not in made:
            raise ValueError(
                f"graph_mode rewrites {node.target} for its outputs {made}; {user.name} reads "
                f"{'output ' + str(index) if index is not None else 'it whole'}. Extend graph_mode"
            )
        replace_node(user, out[cast(int, index)].node, added, reason)  # an index in `made`
    graph.erase_node(node)


def _values(nodes: list[Node], fake_mode: FakeTensorMode) -> None:
    """`meta["val"]` of each new node, in order, from its inputs' values."""
    with fake_mode, enable_python_dispatcher():
        for node in nodes:
            if "val" in node.meta or node.op != "call_function":
                continue
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
            node.meta["val"] = cast(Callable[..., Any], node.target)(*args, **kwargs)


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


_F32_EXPONENT = 2**23
"""The unit of an fp32's exponent field in its bits as an int32."""


def _int_scalar(emit, value, like):
    return emit.call(aten.scalar_tensor.default, value, dtype=torch.int32, device=like.device)


def _frexp(emit, val, x):
    """`frexp` of fp32 `x` from its bits: the exponent field e (a subnormal scaled by 2^64
    first) gives the exponent e - 126, and the bits with that field set to 126 the mantissa in
    [0.5, 1) with x's sign. Zero: (0, 0). Not inf or NaN (the quantisations never take them)."""
    mantissa_val, _ = val
    if mantissa_val.dtype != torch.float32:
        raise ValueError(f"graph_mode rewrites frexp of float32, got {mantissa_val.dtype}")
    magnitude = aten.abs.default(x)
    subnormal = aten.logical_and.default(
        aten.lt.Scalar(magnitude, 2.0**-126), aten.gt.Scalar(magnitude, 0.0)
    )
    x = aten.where.self(subnormal, aten.mul.Scalar(x, 2.0**64), x)
    bits = aten.view.dtype(x, torch.int32)
    field = aten.floor_divide.default(
        aten.bitwise_and.Tensor(bits, _int_scalar(emit, 0x7F800000, mantissa_val)),
        _int_scalar(emit, _F32_EXPONENT, mantissa_val),
    )
    zero = aten.eq.Scalar(x, 0.0)
    shift = aten.where.self(
        subnormal, _int_scalar(emit, 64, mantissa_val), _int_scalar(emit, 0, mantissa_val)
    )
    exponent = aten.sub.Tensor(aten.sub.Scalar(field, 126), shift)
    exponent = aten.where.self(zero, _int_scalar(emit, 0, mantissa_val), exponent)
    kept = aten.bitwise_and.Tensor(
        bits, _int_scalar(emit, -0x7F800001, mantissa_val)
    )  # sign, fraction
    mantissa = aten.view.dtype(
        aten.bitwise_or.Tensor(kept, _int_scalar(emit, 126 * _F32_EXPONENT, mantissa_val)),
        torch.float32,
    )
    mantissa = aten.where.self(zero, x, mantissa)
    return mantissa, exponent


def _power_of_two(emit, exponent, like):
    """fp32 `2^exponent` for int exponents in [-126, 127], made from its bits."""
    field = aten.mul.Tensor(
        aten.add.Scalar(aten._to_copy.default(exponent, dtype=torch.int32), 127),
        _int_scalar(emit, _F32_EXPONENT, like),
    )
    return aten.view.dtype(field, torch.float32)


def _ldexp(emit, val, x, exponent):
    """`x * 2^e` as two products by powers of two made from their bits (each half of e in
    [-75, 64] for e in [-150, 128])."""
    if val.dtype != torch.float32:
        raise ValueError(f"graph_mode rewrites ldexp to float32, got {val.dtype}")
    first = aten.floor_divide.default(exponent, 2)
    second = aten.sub.Tensor(exponent, first)
    x = aten.mul.Tensor(x, _power_of_two(emit, first, val))
    return aten.mul.Tensor(x, _power_of_two(emit, second, val))


def _cummax(emit, val, x, dim):
    """The running max along `dim` (of static size) as a scan: after the step of shift s, entry i
    holds the max of entries i - 2s + 1 .. i."""
    values_val, _ = val
    dim %= values_val.dim()
    n = values_val.shape[dim]
    if not isinstance(n, int):  # a symbolic length (the cache's): the max over a mask j <= i
        if dim != values_val.dim() - 1:
            raise ValueError(f"graph_mode rewrites cummax along a symbolic last dim, got dim {dim}")
        index = emit.call(
            aten.arange.default,
            aten.sym_size.int(x, dim),
            dtype=torch.int64,
            device=values_val.device,
        )
        earlier = aten.le.Tensor(aten.unsqueeze.default(index, 0), aten.unsqueeze.default(index, 1))
        lowest = emit.call(
            aten.scalar_tensor.default,
            float("-inf"),
            dtype=values_val.dtype,
            device=values_val.device,
        )
        candidates = aten.where.self(earlier, aten.unsqueeze.default(x, -2), lowest)  # [..., i, j]
        return aten.max.dim(candidates, -1)[0], None
    shift = 1
    while shift < n:
        # -inf rows in front, shaped like the first `shift` rows (no size spelled out: the
        # others may be symbolic)
        lowest = aten.full_like.default(aten.slice.Tensor(x, dim, 0, shift), float("-inf"))
        shifted = aten.cat.default([lowest, aten.slice.Tensor(x, dim, 0, n - shift)], dim)
        x = aten.maximum.default(x, shifted)
        shift *= 2
    return x, None


_SAME_WIDTH_INT = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def _signbit(emit, val, x):
    dtype = x.node.meta["val"].dtype
    if dtype not in _SAME_WIDTH_INT:
        raise ValueError(
            f"graph_mode rewrites signbit of float32 / bfloat16 / float16, got {dtype}"
        )
    return aten.lt.Scalar(aten.view.dtype(x, _SAME_WIDTH_INT[dtype]), 0)


def _left_shift(emit, val, x, shift):
    if (
        val.dtype.is_floating_point
        or not isinstance(shift, int)
        or not 0 <= shift < 8 * val.itemsize
    ):
        raise ValueError(
            f"graph_mode rewrites an integer shift left by a constant, got {val.dtype} << {shift}"
        )
    return aten.mul.Tensor(
        x, emit.call(aten.scalar_tensor.default, 2**shift, dtype=val.dtype, device=val.device)
    )


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
    aten.cummax.default: _cummax,
    aten.frexp.Tensor: _frexp,
    aten.ldexp.Tensor: _ldexp,
    aten.signbit.default: _signbit,
    aten.__lshift__.Scalar: _left_shift,
    aten.roll.default: _roll,
    aten.bitwise_xor.Tensor: _bitwise_xor,
    aten.copysign.Tensor: _copysign,
}
NPU_KERNEL_GAPS = (aten.frexp.Tensor, aten.copysign.Tensor)
"""The ATen ops of our graphs torch_npu 2.13.0 has no NPU kernel for (their composite kernels
call `frexp.Tensor_out` and `copysign.out`, which it does not register:
`tools/torchair_coverage.py --lowering npugraph_ex`): `npu_ops` makes their rewrites above."""
