"""Custom ops of the model: the routed experts as one opaque node `dsv41::routed_experts`
(`dsv41::routed_experts_fp4` with the weights as released), an FP8 linear's weight decoded
from its released bytes, `dsv41::fp8_weight`, and an Engram table's lookup,
`dsv41::engram_lookup` (at the end).

The compiler sees one node with a declared sharding rule instead of a data-dependent loop over
experts. Contract (global, single-device view):

    routed_experts(x [T, D], topk_idx [T, K] int64, topk_weight [T, K] fp32,
                   w1 [E, I, D], w2 [E, D, I], w3 [E, I, D], swiglu_limit,
                   fp8_hidden=False) -> [T, D] fp32

`out[t] = sum_k topk_weight[t, k] * expert_{topk_idx[t, k]}(x[t])`, accumulated in fp32.
`topk_idx == -1` marks "no assignment" (padding rows): it contributes nothing. `fp8_hidden`
(the official numerics) FP8-quantises each expert's hidden activation before `w2`, per row:
the op takes `x` as it comes (the official numerics quantise it before the op, once for the
routed and the shared experts), so a row's result depends on that row alone either way.

    routed_experts_fp4(x, topk_idx, topk_weight, w1 [E, I, D/2] int8, s1 [E, I, D/32] e8m0,
                       w2 [E, D, I/2], s2 [E, D, I/32], w3 [E, I, D/2], s3 [E, I, D/32],
                       swiglu_limit, fp8_hidden=False) -> [T, D] fp32

is the same op with each weight as the checkpoint stores it (`model.quant`, "FP4": e2m1 codes
two per byte, one e8m0 scale per 32 inputs): an expert's weights are decoded to `x`'s dtype
when the expert has rows, so the result is `routed_experts` of the decoded weights, bit for
bit, and no decoded copy outlives the call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv41_compile.deepseek_v41.model.numerics import act_quant_dequant
from dsv41_compile.deepseek_v41.model.quant import e2m1_values, e8m0_powers

aten = torch.ops.aten


def clamped_swiglu(gate_TI: Tensor, up_TI: Tensor, swiglu_limit: float) -> Tensor:
    """`silu(min(gate, L)) * clamp(up, -L, L)` (no clamp when L = 0), in the inputs' dtype.
    Written with ATen ops so that graph mode builds the same arithmetic into its graph
    (`graph_mode.routed_experts_grouped` calls it on FX proxies)."""
    if swiglu_limit > 0:
        up_TI = aten.clamp.default(up_TI, -swiglu_limit, swiglu_limit)
        gate_TI = aten.clamp.default(gate_TI, None, swiglu_limit)
    return aten.mul.Tensor(aten.silu.default(gate_TI), up_TI)


def swiglu_expert(
    x_TD: Tensor,
    w1_ID: Tensor,
    w2_DI: Tensor,
    w3_ID: Tensor,
    swiglu_limit: float,
    weight_T: Tensor | None = None,
    fp8_hidden: bool = False,
) -> Tensor:
    """Clamped SwiGLU expert: `w2((silu(clamp(w1 x)) * clamp(w3 x)) * weight)`.

    Gate and up are taken to fp32; the up projection is clamped to [-L, L] and the gate from
    above only. The routing weight multiplies the hidden activation in fp32, before `w2`; the
    product is cast to the activation dtype, then (`fp8_hidden`) FP8-quantised per 32 values
    (`numerics.act_quant_dequant`), as the official FP8 / FP4 GEMM of `w2` takes it. Output in
    the activation dtype.
    """
    gate_TI = F.linear(x_TD, w1_ID).float()
    up_TI = F.linear(x_TD, w3_ID).float()
    h_TI = clamped_swiglu(gate_TI, up_TI, swiglu_limit)
    if weight_T is not None:
        h_TI = h_TI * weight_T[:, None]
    h_TI = h_TI.to(x_TD.dtype)
    if fp8_hidden:
        h_TI = act_quant_dequant(h_TI)
    return F.linear(h_TI, w2_DI)


def _by_expert(
    x: Tensor, topk_idx: Tensor, topk_weight: Tensor, n_experts: int
) -> tuple[Tensor, Tensor, Tensor, list[int]]:
    """The valid (token, k) assignments sorted by expert (stable): their tokens, rows of `x`,
    fp32 weights, and the count per expert."""
    T, K = topk_idx.shape
    expert_A = topk_idx.reshape(-1)
    token_A = torch.arange(T, device=x.device).repeat_interleave(K)
    weight_A = topk_weight.reshape(-1).float()
    assigned = expert_A >= 0
    expert_A, token_A, weight_A = expert_A[assigned], token_A[assigned], weight_A[assigned]
    order = torch.argsort(expert_A, stable=True)
    expert_A, token_A, weight_A = expert_A[order], token_A[order], weight_A[order]
    counts = torch.bincount(expert_A, minlength=n_experts).tolist()
    return token_A, x[token_A], weight_A, counts


def _by_expert_groups(
    x: Tensor,
    topk_idx: Tensor,
    topk_weight: Tensor,
    n_experts: int,
    weights: Callable[[int], tuple[Tensor, Tensor, Tensor]],
    swiglu_limit: float,
    fp8_hidden: bool,
) -> Tensor:
    """Each expert with rows on its contiguous group (`weights(e)`: its w1, w2, w3), the
    weighted outputs added back to their tokens in fp32."""
    token_A, x_AD, weight_A, counts = _by_expert(x, topk_idx, topk_weight, n_experts)
    out_TD = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            y = swiglu_expert(x_AD[rows], *weights(e), swiglu_limit, weight_A[rows], fp8_hidden)
            out_TD.index_add_(0, token_A[rows], y.float())
        start += count
    return out_TD


@torch.library.custom_op("dsv41::routed_experts", mutates_args=())
def routed_experts(
    x: Tensor,
    topk_idx: Tensor,
    topk_weight: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Tensor,
    swiglu_limit: float,
    fp8_hidden: bool = False,
) -> Tensor:
    """Reference kernel: sort the (token, k) assignments by expert, run each expert on its
    contiguous group, scatter-add the weighted outputs back to their tokens in fp32."""
    weights = lambda e: (w1[e], w2[e], w3[e])  # noqa: E731
    return _by_expert_groups(
        x, topk_idx, topk_weight, w1.shape[0], weights, swiglu_limit, fp8_hidden
    )


@routed_experts.register_fake
def _(x, topk_idx, topk_weight, w1, w2, w3, swiglu_limit, fp8_hidden=False):
    torch._check(topk_idx.shape == topk_weight.shape, lambda: "topk_idx / topk_weight mismatch")
    torch._check(topk_idx.shape[0] == x.shape[0], lambda: "topk_idx rows must match x rows")
    torch._check(w1.shape[2] == x.shape[1], lambda: "w1 must be [E, I, D]")
    torch._check(w2.shape[1] == x.shape[1], lambda: "w2 must be [E, D, I]")
    return x.new_empty(x.shape, dtype=torch.float32)


def fp4_weight(packed: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """One expert's weight from its released bytes: `packed` int8 [out, in/2] (e2m1 pairs, low
    nibble first), `scale` e8m0 [out, in/32] -> `dtype` [out, in], each value a code times its
    block's power of two, in fp32 (exact), then `dtype` -- what loading the checkpoint into a
    "dequantized" model writes (`quant.dequantize_fp4`), without its checks (made on load)."""
    values = e2m1_values(packed)
    powers = e8m0_powers(scale.view(torch.uint8))
    return (values.unflatten(-1, (-1, 32)) * powers[..., None]).flatten(-2).to(dtype)


@torch.library.custom_op("dsv41::routed_experts_fp4", mutates_args=())
def routed_experts_fp4(
    x: Tensor,
    topk_idx: Tensor,
    topk_weight: Tensor,
    w1: Tensor,
    s1: Tensor,
    w2: Tensor,
    s2: Tensor,
    w3: Tensor,
    s3: Tensor,
    swiglu_limit: float,
    fp8_hidden: bool = False,
) -> Tensor:
    """`routed_experts` with FP4 weights: each expert with rows is decoded (`fp4_weight`) for
    its group only."""

    def weights(e: int) -> tuple[Tensor, Tensor, Tensor]:
        w1_e, w2_e, w3_e = (
            fp4_weight(w[e], s[e], x.dtype) for w, s in ((w1, s1), (w2, s2), (w3, s3))
        )
        return w1_e, w2_e, w3_e

    return _by_expert_groups(
        x, topk_idx, topk_weight, w1.shape[0], weights, swiglu_limit, fp8_hidden
    )


@routed_experts_fp4.register_fake
def _(x, topk_idx, topk_weight, w1, s1, w2, s2, w3, s3, swiglu_limit, fp8_hidden=False):
    torch._check(topk_idx.shape == topk_weight.shape, lambda: "topk_idx / topk_weight mismatch")
    torch._check(topk_idx.shape[0] == x.shape[0], lambda: "topk_idx rows must match x rows")
    torch._check(2 * w1.shape[2] == x.shape[1], lambda: "w1 must be [E, I, D/2]")
    torch._check(w2.shape[1] == x.shape[1], lambda: "w2 must be [E, D, I/2]")
    torch._check(32 * s1.shape[2] == x.shape[1], lambda: "s1 must be [E, I, D/32]")
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("dsv41::fp8_weight", mutates_args=())
def fp8_weight(weight: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """A linear's weight from its released bytes (one opaque node, so that the compiler places
    the codes and their scales together, by a declared rule):

        fp8_weight(weight float8_e4m3fn [out, in], scale float8_e8m0fnu [ceil(out/32),
                   ceil(in/32)], dtype) -> dtype [out, in]

    each value its code times its 32 x 32 block's power of two, in fp32 (exact), then `dtype`:
    what loading the checkpoint into a "dequantized" model writes (`quant.dequantize_fp8`),
    without its checks (made on load). A part of the weight made of whole blocks, with the
    scales of those blocks, decodes to that part."""
    out, inputs = weight.shape
    powers = e8m0_powers(scale.view(torch.uint8))
    per_value = powers.repeat_interleave(32, 0)[:out].repeat_interleave(32, 1)[:, :inputs]
    return (weight.float() * per_value).to(dtype)


@fp8_weight.register_fake
def _(weight, scale, dtype):
    torch._check(
        scale.shape[0] * 32 >= weight.shape[0] and scale.shape[1] * 32 >= weight.shape[1],
        lambda: "one scale per 32 x 32 block of the weight",
    )
    return weight.new_empty(weight.shape, dtype=dtype)


@torch.library.custom_op("dsv41::engram_lookup", mutates_args=())
def engram_lookup(
    table: Tensor, scale: Tensor, rows: Tensor, columns: list[int], dtype: torch.dtype
) -> Tensor:
    """Rows of an Engram table, dequantised (one opaque node, so the compiler places the table
    by a declared rule instead of an `index` it cannot shard):

        engram_lookup(table float8_e4m3fn [N, W], scale float8_e8m0fnu [N, W/32],
                      rows int64 [..., C], columns [C + 1], dtype) -> dtype [..., C, W]

    `out[..., c, :] = table[rows[..., c]] * 2^(scale byte - 127)` per block of 32, in fp32, then
    `dtype` (exact: an e4m3 value times a power of two is a bf16 value). `columns` are the
    table's column bounds: column c's rows are `[columns[c], columns[c + 1])`, and `rows[..., c]`
    is one of them (what lets the compiler split the table by columns)."""
    codes = table.view(torch.uint8)[rows]
    return engram_dequantize(codes, scale.view(torch.uint8)[rows], dtype)


def engram_dequantize(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """Looked-up Engram rows from their bytes: `codes` uint8 [..., W] (e4m3), `scales` uint8
    [..., W/32] (e8m0): `e4m3(code) * 2^(scale - 127)` per block of 32, in fp32, as `dtype`.
    Written with ATen ops, so that the compiler builds the same arithmetic into a graph where
    the rows arrive from other ranks (`core.adapter.TableLookup`)."""
    values = aten._to_copy.default(aten.view.dtype(codes, torch.float8_e4m3fn), dtype=torch.float32)
    exponents = aten.sub.Tensor(aten._to_copy.default(scales, dtype=torch.float32), 127.0)
    blocks = aten.unflatten.int(values, -1, [-1, 32])
    powers = aten.pow.Scalar(2.0, exponents)  # exact: the exponents are integers
    scaled = aten.mul.Tensor(blocks, aten.unsqueeze.default(powers, -1))
    return aten._to_copy.default(aten.flatten.using_ints(scaled, -2), dtype=dtype)


@engram_lookup.register_fake
def _(table, scale, rows, columns, dtype):
    torch._check(scale.shape[0] == table.shape[0], lambda: "scale must have one row per row")
    torch._check(scale.shape[1] * 32 == table.shape[1], lambda: "one scale per 32 of a row")
    torch._check(len(columns) == rows.shape[-1] + 1, lambda: "one bound per column, and the end")
    return rows.new_empty((*rows.shape, table.shape[1]), dtype=dtype)
