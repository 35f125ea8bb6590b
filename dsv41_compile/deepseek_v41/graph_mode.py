"""DeepSeek V4.1's custom ops in torch_npu's (`lowering="npugraph_ex"` and `"torchair"`): the
rewrites `targets.npu_passes` applies to them (its `npu_ops` and `graph_mode` passes), in
torch_npu's ops (registered when torch_npu is imported;
on CPU by `testing.torchair_standin.register_npu_ops`):

    dsv41::routed_experts       the assignments sorted by expert, `npu_grouped_matmul` per
                                weight with the rows per expert as groups
    dsv41::routed_experts_fp4   where its input is FP8 codes decoded (the official numerics
                                quantise the experts' input): `npu_grouped_matmul` in its MX
                                A8W4 form -- the rows' e4m3 codes with their e8m0 scales, the
                                FP4 weights as released (held in torch_npu's NZ layout, made
                                once when the runtime takes the shard) with theirs -- for w1,
                                w3 and w2, the hidden activation quantised between
                                (`npu_dynamic_mx_quant`): no FP4 weight is decoded. Otherwise
                                (an input in bf16) each local expert's weights decoded
                                (`npu_anti_mx_quant`), then as dsv41::routed_experts
    dsv41::fp8_weight           the e4m3 codes decoded with their block scales, each 32 x 32
                                block's scale spread over its 32 rows (`npu_anti_mx_quant`);
                                where the product's input is FP8-quantised too, see aten.mm
    dsv41::act_quant_dequant    `npu_dynamic_mx_quant` to e4m3 in blocks of 32 with the
                                rounded-up power-of-two scale (scale_alg=1), and back
                                (`npu_anti_mx_quant`)
    aten.mm(a, t(w))            where `a` and `w` are both e4m3 codes decoded by the rewrites
                                above (an FP8 linear under the official numerics): one
                                `npu_quant_matmul` of the codes with their scales (MXFP8,
                                group_sizes [1, 1, 32]); any other mm stays
    dsv41::fp8_encode_rows      the FP8 rows a collective moves (quantised transport): the
                                codes of `npu_dynamic_mx_quant` as bytes, then its scales
    dsv41::fp8_decode_rows      those rows back to bf16 (`npu_anti_mx_quant`)
    dsv41::engram_lookup        the rows' bytes gathered, dequantised by the op's own formula
    dsv41::sparse_attention     `npu_sparse_flash_attention` over one KV source per call --
                                this call's rows, then every slot's window ring, then every
                                slot's compressed entries, decoded to the queries' dtype -- with
                                each query's window and picks as one index list into it
                                (`sparse_attention_sfa`); with npu_attention="gathered" the
                                model's own ATen (`ModelAdapter.decomposed`)

The act quantisation is the official one except in a block whose largest magnitude is below
1e-4: the official `act_quant` floors that magnitude at 1e-4 (scale 2^-22), the NPU op does not
(a finer scale, codes at least as precise).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Proxy

from dsv41_compile.core.emitter import cast
from dsv41_compile.deepseek_v41.model.numerics import KV_FP4_BLOCK
from dsv41_compile.deepseek_v41.model.ops import clamped_swiglu, engram_dequantize
from dsv41_compile.formats import e2m1_table
from dsv41_compile.targets.npu_dtypes import DTYPE_CODES, E2M1, E4M3, E8M0, NPU_DTYPES
from dsv41_compile.targets.npu_passes import Lowered, ge_refuses_mx_a8w4, lowering_now

__all__ = [
    "act_quant_dequant_mx",
    "sparse_attention_sfa",
    "engram_lookup_gathered",
    "fp8_decode_rows_mx",
    "fp8_encode_rows_mx",
    "fp8_matmul",
    "fp8_weight_decoded",
    "grouped_matmul",
    "npu_op",
    "routed_experts_fp4_grouped",
    "routed_experts_grouped",
]


def engram_lookup_gathered(emit, val, table, scale, rows, columns, dtype):
    """`dsv41::engram_lookup` for graph mode: the rows' bytes gathered (`index_select` of the
    table and of its scales viewed as uint8), then the op's own dequantisation
    (`model.ops.engram_dequantize`)."""
    flat = aten.view.default(rows, [-1])
    codes = aten.index_select.default(aten.view.dtype(table, torch.uint8), 0, flat)
    scales = aten.index_select.default(aten.view.dtype(scale, torch.uint8), 0, flat)
    shape = [-1, *rows.node.meta["val"].shape[1:]]
    width = table.node.meta["val"].shape[1]
    codes = aten.view.default(codes, [*shape, width])
    scales = aten.view.default(scales, [*shape, width // 32])
    return engram_dequantize(codes, scales, dtype)


aten = torch.ops.aten


def routed_experts_grouped(
    emit, val, x, topk_idx, topk_weight, w1, w2, w3, swiglu_limit, fp8_hidden=False, n_experts=None
):
    """`dsv41::routed_experts` for graph mode: the (row, k) assignments sorted by expert,
    torch_npu's grouped matmul for w1 / w3 / w2 with the rows per expert as groups, the clamped
    SwiGLU and the routing weight in fp32, `index_add` back to the rows in expert order (the
    reference kernel's order). Static sizes, no host read, no E x FLOPs; unassigned rows are
    sorted past the last group (what the kernel leaves there is not documented: zeroed before
    the sum). Under the official numerics (`fp8_hidden`) the hidden activation entering w2 is
    FP8-quantised per 32 values (`act_quant_dequant_mx`)."""
    if n_experts is None:  # else w1 is a node the rewrite made: no value recorded yet
        n_experts = w1.node.meta["val"].shape[0]
    dtype = x.node.meta["val"].dtype
    sorted_key, order, row, counts = _by_expert_order(emit, val, topk_idx, n_experts)
    rows = aten.index_select.default(x, 0, row)
    weight = aten.index_select.default(aten.view.default(topk_weight, [-1]), 0, order)
    gate = cast(_grouped(rows, w1, counts), dtype, torch.float32)
    up = cast(_grouped(rows, w3, counts), dtype, torch.float32)
    h = aten.mul.Tensor(clamped_swiglu(gate, up, swiglu_limit), aten.unsqueeze.default(weight, 1))
    h = cast(h, torch.float32, dtype)
    if fp8_hidden:
        h = _quant_dequant(h, dtype)
    y = cast(_grouped(h, w2, counts), dtype, torch.float32)
    # rows past the last group (unassigned) are not defined by the kernel: zeroed, never read
    assigned = aten.unsqueeze.default(aten.lt.Scalar(sorted_key, n_experts), 1)
    zero = emit.call(aten.scalar_tensor.default, 0.0, dtype=torch.float32, device=val.device)
    y = aten.where.self(assigned, y, zero)
    # each row's outputs added in fp32 in expert order (the order they come in): the kernel's
    return aten.index_add.default(aten.zeros_like.default(x, dtype=torch.float32), 0, row, y)


def npu_op(name: str) -> Any:
    """torch_npu's op `name` (registered when torch_npu is imported; on CPU by
    `testing.torchair_standin.register_npu_ops`), or an error saying so."""
    if not hasattr(torch.ops.npu, name):
        raise ValueError(
            f"graph mode computes with torch_npu's {name}, which is not registered: import "
            "torch_npu first (lowering='npugraph_ex' and 'torchair' do), or on CPU call "
            "dsv41_compile.testing.torchair_standin.register_npu_ops()"
        )
    return getattr(torch.ops.npu, name).default


def _mx_quant(x: Proxy) -> Proxy:
    """`x` as e4m3 codes and e8m0 scale pairs, in blocks of 32 along its last dim, each scale
    amax / 448 rounded up to a power of two (scale_alg=1, the official rule)."""
    return npu_op("npu_dynamic_mx_quant")(
        x, axis=-1, round_mode="rint", dst_type=E4M3, block_size=32, scale_alg=1
    )


def _quant_dequant(x: Proxy, dtype: torch.dtype) -> Proxy:
    """`x` through FP8 e4m3 and back, in blocks of 32 along its last dim."""
    quantised = _mx_quant(x)
    anti_quant = npu_op("npu_anti_mx_quant")
    codes, scales = quantised[0], quantised[1]  # type: ignore[index]  # fx.Proxy's operators are set at import (torch.fx.proxy)
    return anti_quant(codes, scales, axis=-1, dst_type=DTYPE_CODES[dtype], src_type=E4M3)


def act_quant_dequant_mx(emit, val, x):
    """`dsv41::act_quant_dequant` (numerics="official"): `npu_dynamic_mx_quant` to e4m3 with
    the rounded-up power-of-two scale per 32 values (scale_alg=1, the official rule), then
    `npu_anti_mx_quant` back to bf16. Where the value feeds an FP8 linear, the product is one
    `npu_quant_matmul` (`fp8_matmul`)."""
    return _quant_dequant(x, val.dtype)


def fp8_encode_rows_mx(emit, val, x):
    """`dsv41::fp8_encode_rows`: bf16 `[..., n]` as bytes `[..., n + n / 32]`, the e4m3 codes,
    then one e8m0 scale per 32 (the MX op's pairs of scales, the pad of an odd count dropped)."""
    shape = list(val.shape)
    n = shape[-1] * 32 // 33
    quantised = _mx_quant(x)
    codes = aten.view.dtype(quantised[0], torch.uint8)
    scales = aten.reshape.default(quantised[1], [*_view_lead(shape), 2 * -(-n // 64)])
    scales = aten.slice.Tensor(scales, -1, 0, n // 32)
    return aten.cat.default([codes, scales], -1)


def fp8_decode_rows_mx(emit, val, rows):
    """`dsv41::fp8_decode_rows`: bytes `[..., n + n / 32]` back to bf16 `[..., n]`."""
    shape = list(val.shape)
    return _fp8_rows_decoded(rows, _view_lead(shape), shape[-1], val.dtype)


def _fp8_rows_decoded(rows: Proxy, lead: list[int], n: int, dtype: torch.dtype) -> Proxy:
    """FP8 rows `[*lead, n + n / 32]` (leading dims `lead`, -1 for T) as `dtype` `[*lead, n]`:
    the e4m3 codes with their e8m0 scales in pairs (`npu_anti_mx_quant`)."""
    codes = aten.view.dtype(aten.slice.Tensor(rows, -1, 0, n), torch.float8_e4m3fn)
    scales = aten.slice.Tensor(rows, -1, n, n + n // 32)
    if (n // 32) % 2:
        scales = aten.constant_pad_nd.default(scales, [0, 1], 0)
    pairs = aten.reshape.default(scales, [*lead, -(-n // 64), 2])
    return npu_op("npu_anti_mx_quant")(
        codes, pairs, axis=-1, dst_type=DTYPE_CODES[dtype], src_type=E4M3
    )


def _view_lead(shape: list[Any]) -> list[Any]:
    """The leading dims of `shape` for a view: the one symbolic size (the token count) as -1."""
    return [-1 if isinstance(s, torch.SymInt) else int(s) for s in shape[:-1]]


def _scale_pairs(scale: Proxy, rows: int, per: int) -> Proxy:
    """e8m0 scales `[..., ceil(rows / per), ceil(k / 32)]`, one per `per` rows and 32 values of
    a row (per = 32 for an FP8 weight's blocks, 1 for the experts' FP4 weights), as the MX ops
    take them: one per row, those along a row in pairs `[..., rows, ceil(k / 64), 2]` (an odd
    count padded with a zero byte), uint8."""
    shape = list(scale.node.meta["val"].shape)
    lead, blocks = shape[:-2], shape[-1]
    scale = aten.view.dtype(scale, torch.uint8)
    if per > 1:  # each block's scale on each of its rows
        spread = aten.expand.default(
            aten.unsqueeze.default(scale, -2), [*lead, shape[-2], per, blocks]
        )
        flat = aten.reshape.default(spread, [*lead, shape[-2] * per, blocks])
        scale = aten.slice.Tensor(flat, -2, 0, rows)
    if blocks % 2:
        scale = aten.constant_pad_nd.default(scale, [0, 1], 0)
    return aten.reshape.default(scale, [*lead, rows, (blocks + 1) // 2, 2])


def fp8_weight_decoded(emit, val, weight, scale, dtype):
    """`dsv41::fp8_weight`: the e4m3 codes times their 32 x 32 block's scale, spread over the
    block's rows (`npu_anti_mx_quant` scales blocks of 32 along a row), in `dtype`."""
    rows = weight.node.meta["val"].shape[0]
    return npu_op("npu_anti_mx_quant")(
        weight, _scale_pairs(scale, rows, 32), axis=-1, dst_type=DTYPE_CODES[dtype], src_type=E4M3
    )


def fp8_matmul(emit, val, a, b):
    """`aten.mm(a, b)` where `a` is FP8 codes decoded (`npu_anti_mx_quant`, e4m3, along its
    rows; then, maybe, rows of it taken or cast: `_e4m3_rows`) and `b` the transpose of an FP8
    weight decoded the same way: torch_npu's MXFP8 `npu_quant_matmul` of the codes, `b`'s scales
    `[K/64, N, 2]`, `a`'s as the per-token ones `[M, K/64, 2]`. None (the mm stays) for any
    other mm."""
    if b.node.target is not aten.t.default:
        return None
    w = _decoded_e4m3(b.node.args[0])
    x = _e4m3_rows(emit, a.node)
    if x is None or w is None or x[2] != w.kwargs["dst_type"]:
        return None
    codes, pairs, out_code = x
    return npu_op("npu_quant_matmul")(
        codes,
        aten.t.default(emit.proxy(w.args[0])),
        aten.transpose.int(emit.proxy(w.args[1]), 0, 1),
        pertoken_scale=pairs,
        output_dtype=out_code,
        scale_dtype=E8M0,
        pertoken_scale_dtype=E8M0,
        group_sizes=[1, 1, 32],
    )


def _decoded_e4m3(node: Any) -> Any:
    """`node` when it decodes 2-D e4m3 codes along their rows (`npu_anti_mx_quant`), else
    None."""
    if not hasattr(torch.ops.npu, "npu_anti_mx_quant") or not isinstance(node, torch.fx.Node):
        return None
    if node.target is not torch.ops.npu.npu_anti_mx_quant.default:
        return None
    if node.kwargs.get("src_type") != E4M3 or node.kwargs.get("axis") != -1:
        return None
    return node if node.args[0].meta["val"].dim() == 2 else None


def _e4m3_rows(emit, node: Any) -> tuple[Proxy, Proxy, int] | None:
    """(the e4m3 codes, their e8m0 scale pairs `[..., ceil(K/64), 2]`, the dtype code of the
    values) when `node` is e4m3 codes decoded along their last dim, in blocks of 32, as its
    values are (`_e4m3_blocks`). Else None."""
    found = _e4m3_blocks(emit, node)
    if found is None:
        return None
    codes, scales, code = found
    shape = list(node.meta["val"].shape)  # the new nodes' values are made after the rewrite
    blocks = -(-shape[-1] // 32)
    if blocks % 2:
        scales = aten.constant_pad_nd.default(scales, [0, 1], 0)
    return codes, aten.reshape.default(scales, [*_view_lead(shape), (blocks + 1) // 2, 2]), code


def cast_list(value: Any) -> list[int]:
    return [int(v) for v in value]


def _e4m3_blocks(emit, node: Any) -> tuple[Proxy, Proxy, int] | None:
    """(codes [..., K], one e8m0 byte per block of 32 [..., K/32], the values' dtype code)
    when `node` holds e4m3 codes decoded along their last dim (`npu_anti_mx_quant`), then
    rearranged without splitting a block: rows taken along dim 0 (a slice, a part of a split:
    a gathered value's padding rows dropped), leading dims unflattened or permuted, a view
    whose last dim is a whole number of blocks (rows of several blocks made one: the groups of
    an exchanged value side by side), a clone, a cast to another float dtype (exact: a code
    times a power of two is a bf16 value). The codes and scales are rearranged the same way
    (new nodes before the node being rewritten). Else None."""
    if not isinstance(node, torch.fx.Node):
        return None
    decoded = _decoded_e4m3(node)
    if decoded is not None:
        codes, pairs = emit.proxy(decoded.args[0]), emit.proxy(decoded.args[1])
        k = decoded.args[0].meta["val"].shape[-1]
        flat = aten.flatten.using_ints(pairs, -2)  # the pairs' bytes in order: one per block
        return codes, aten.slice.Tensor(flat, -1, 0, -(-k // 32)), decoded.kwargs["dst_type"]
    target, args = node.target, node.args
    if target is operator.getitem:
        split = args[0]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if split.target is not aten.split_with_sizes.default or dim != 0:
            return None
        inner = _e4m3_blocks(emit, split.args[0])
        if inner is None:
            return None
        sizes, i = emit.proxy(split.args[1]), args[1]
        codes, scales, code = inner
        parts = (aten.split_with_sizes.default(t, sizes, 0)[i] for t in (codes, scales))
        return (*parts, code)  # type: ignore[return-value]
    rearranging = (
        aten._to_copy.default, aten.clone.default, aten.slice.Tensor, aten.unflatten.int,
        aten.permute.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
    )  # fmt: skip
    inner = _e4m3_blocks(emit, args[0]) if target in rearranging else None
    if inner is None:
        return None
    codes, scales, code = inner
    ndim = node.meta["val"].dim()
    if target is aten._to_copy.default and set(node.kwargs) <= {"dtype"}:
        dtype = node.kwargs.get("dtype")
        out = DTYPE_CODES.get(dtype) if isinstance(dtype, torch.dtype) else None
        return None if out is None else (codes, scales, out)
    if target is aten.clone.default:
        return codes, scales, code
    if target is aten.slice.Tensor and args[1] % ndim == 0:
        bounds = args[2:]
        return aten.slice.Tensor(codes, 0, *bounds), aten.slice.Tensor(scales, 0, *bounds), code
    if target is aten.unflatten.int and args[1] % ndim != ndim - 1:
        sizes = emit.proxy(args[2])
        return (*(aten.unflatten.int(t, args[1], sizes) for t in (codes, scales)), code)
    if target is aten.permute.default and cast_list(args[1])[-1] % ndim == ndim - 1:
        dims = cast_list(args[1])
        return aten.permute.default(codes, dims), aten.permute.default(scales, dims), code
    if target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        shape = list(node.meta["val"].shape)
        source = args[0].meta["val"].shape[-1]
        if not (isinstance(shape[-1], int) and shape[-1] % 32 == 0 and source % 32 == 0):
            return None
        lead = _view_lead(shape)
        return (
            aten.reshape.default(codes, [*lead, shape[-1]]),
            aten.reshape.default(scales, [*lead, shape[-1] // 32]),
            code,
        )
    return None


def routed_experts_fp4_grouped(
    emit, val, x, topk_idx, topk_weight, w1, s1, w2, s2, w3, s3, swiglu_limit, fp8_hidden=False
):
    """`dsv41::routed_experts_fp4`. Under the official numerics (`fp8_hidden`) with an input
    of FP8 codes decoded -- the experts' input quantised (`act_quant_dequant_mx`, or FP8 rows
    the EP dispatch moved, `fp8_decode_rows_mx`) -- the grouped matmul takes the codes and the
    FP4 weights as they are (`_a8w4_experts`) -- unless torchair's GE would refuse that form
    (`targets.npu_passes.ge_refuses_mx_a8w4`: a device other than a 950, one local expert,
    K = 64), where torchair keeps the decoded form below. Otherwise each of the rank's experts' weights is
    decoded from its FP4 bytes (e2m1 pairs, low nibble first, an e8m0 scale per 32 along a row:
    `npu_anti_mx_quant`) to the activation dtype for the call, then the grouped matmuls of
    `routed_experts_grouped`: the grouped matmul has no MX form with a bf16 input, and
    quantising the input would change the numerics."""
    rows = _e4m3_rows(emit, x.node) if fp8_hidden else None
    groups, _, half_k = w1.node.meta["val"].shape  # [E, I, D/2]: two e2m1 codes a byte
    ks = (2 * half_k, 2 * w2.node.meta["val"].shape[2])
    if rows is not None and ge_refuses_mx_a8w4(groups, ks) is None:
        codes, pairs, out_code = rows
        return _a8w4_experts(
            emit, val, codes, pairs, topk_idx, topk_weight, (w1, s1), (w2, s2), (w3, s3),
            swiglu_limit, out_code,
        )  # fmt: skip
    dtype = x.node.meta["val"].dtype

    def decoded(w: Proxy, s: Proxy) -> Proxy:
        rows = w.node.meta["val"].shape[1]
        return npu_op("npu_anti_mx_quant")(
            aten.view.dtype(w, torch.uint8),
            _scale_pairs(s, rows, 1),
            axis=-1,
            dst_type=DTYPE_CODES[dtype],
            src_type=E2M1,
        )

    return routed_experts_grouped(
        emit,
        val,
        x,
        topk_idx,
        topk_weight,
        decoded(w1, s1),
        decoded(w2, s2),
        decoded(w3, s3),
        swiglu_limit,
        fp8_hidden,
        n_experts=w1.node.meta["val"].shape[0],
    )


def _by_expert_order(emit, val, topk_idx, n_experts):
    """The (row, k) assignments in expert order, unassigned ones (-1) last under key E: the
    sorted keys, each assignment's row and its position in `topk_idx` (flat), and the rows
    per expert (the grouped matmuls' groups)."""
    top_k = topk_idx.node.meta["val"].shape[1]
    experts = emit.call(aten.arange.default, n_experts, dtype=torch.int64, device=val.device)
    none = emit.call(aten.scalar_tensor.default, n_experts, dtype=torch.int64, device=val.device)
    expert = aten.view.default(topk_idx, [-1])
    key = aten.where.self(aten.ge.Scalar(expert, 0), expert, none)
    ordered = aten.sort.default(key)
    sorted_key, order = ordered[0], ordered[1]
    row = aten.floor_divide.default(order, top_k)
    counts = aten.sum.dim_IntList(
        aten.eq.Tensor(aten.unsqueeze.default(sorted_key, 1), experts), [0]
    )
    return sorted_key, order, row, counts


def _a8w4_experts(
    emit, val, codes, pairs, topk_idx, topk_weight, w1s1, w2s2, w3s3, swiglu_limit, out_code
):
    """The routed experts with FP8 rows and FP4 weights, none decoded: the rows' e4m3 `codes`
    and their e8m0 scale `pairs` ([T, D/64, 2]) taken in expert order, `npu_grouped_matmul`'s
    MX A8W4 form for w1 and w3 (each expert's FP4 weight [I, D/2] with its e8m0 scales per 32,
    as the runtime holds them: `A8W4_WEIGHTS`), the clamped SwiGLU and the routing weight in
    fp32, the hidden activation back to the activation dtype and quantised to e4m3 per 32
    (`npu_dynamic_mx_quant`, the official rule: `expert_hidden`), the A8W4 form again for w2,
    the outputs added back to their rows in fp32 in expert order. The output rows past the
    groups' total (unassigned) are not defined by the kernel: zeroed, never read."""
    (w1, s1), (w2, s2), (w3, s3) = w1s1, w2s2, w3s3
    n_experts = w1.node.meta["val"].shape[0]
    sorted_key, order, row, counts = _by_expert_order(emit, val, topk_idx, n_experts)
    rows = aten.index_select.default(codes, 0, row)
    row_pairs = aten.index_select.default(pairs, 0, row)
    weight = aten.index_select.default(aten.view.default(topk_weight, [-1]), 0, order)
    dtype = NPU_DTYPES[out_code]
    gate = cast(_a8w4(rows, row_pairs, w1, s1, counts, out_code), dtype, torch.float32)
    up = cast(_a8w4(rows, row_pairs, w3, s3, counts, out_code), dtype, torch.float32)
    h = aten.mul.Tensor(clamped_swiglu(gate, up, swiglu_limit), aten.unsqueeze.default(weight, 1))
    quantised = _mx_quant(cast(h, torch.float32, dtype))
    h_codes, h_pairs = quantised[0], quantised[1]  # type: ignore[index]
    y = cast(_a8w4(h_codes, h_pairs, w2, s2, counts, out_code), dtype, torch.float32)
    assigned = aten.unsqueeze.default(aten.lt.Scalar(sorted_key, n_experts), 1)
    zero = emit.call(aten.scalar_tensor.default, 0.0, dtype=torch.float32, device=val.device)
    y = aten.where.self(assigned, y, zero)
    return aten.index_add.default(aten.zeros_like.default(codes, dtype=torch.float32), 0, row, y)


def _a8w4(codes: Proxy, pairs: Proxy, w: Proxy, s: Proxy, counts: Proxy, out_code: int) -> Proxy:
    """`npu_grouped_matmul`'s MX A8W4 form: rows of e4m3 `codes` [M, K] with their e8m0 scale
    `pairs` [M, K/64, 2] times expert g's FP4 weight `w[g]` [N, K/2] (e2m1 pairs, low nibble
    first) with its e8m0 scales `s[g]` [N, K/32], transposed as the kernel takes them ([G, K/2,
    N] and [G, K/64, N, 2]), in groups of `counts` rows -> [M, N] in `out_code`'s dtype."""
    rows = w.node.meta["val"].shape[1]
    scale_pairs = aten.transpose.int(_scale_pairs(s, rows, 1), 1, 2)
    weights = aten.transpose.int(aten.view.dtype(w, torch.uint8), 1, 2)
    return grouped_matmul()(
        [codes],
        [weights],
        antiquant_scale=[scale_pairs],
        per_token_scale=[pairs],
        group_list=counts,
        split_item=3,
        group_type=0,
        group_list_type=1,
        output_dtype=out_code,
        weight_dtype=E2M1,
        per_token_scale_dtype=E8M0,
    )[0]


def _grouped(x: Proxy, weights: Proxy, counts: Proxy) -> Proxy:
    """`F.linear(x[group e], weights[e])` for consecutive row groups of sizes `counts`."""
    op = grouped_matmul()
    return op(
        [x],
        [aten.transpose.int(weights, 1, 2)],
        group_list=counts,
        split_item=3,  # one output tensor
        group_type=0,  # groups along x's rows
        group_list_type=1,  # counts, not cumulative
    )[0]


def grouped_matmul() -> Any:
    """torch_npu's `npu_grouped_matmul`."""
    return npu_op("npu_grouped_matmul")


def sparse_attention_sfa(
    emit,
    val,
    q,
    kv,
    ring,
    slot,
    positions,
    start,
    sink,
    window,
    ring_fp8,
    blockwise,
    compressed=None,
    idx=None,
    picked=None,
    compressed_fp4=False,
):
    """`dsv41::sparse_attention` as one `npu_sparse_flash_attention` over one KV source
    `[1, R, 1, d]` (BSND, one batch, one KV head; keys = values), each query's keys one list of
    indices into it (docs/backend.md, "Attention on the NPU"):

    - each query's list `[W + K]`: its window oldest first (this call's rows where the position
      is this call's, else its request's ring as read before this call writes it), then its
      compressed picks; the visible ones first, in that order, the rest -1 (the kernel stops at
      the first -1; `sparse_mode=0`, no mask of its own);
    - the source, one of two, by the rows the compile's workload states (`rows_per_step`,
      `lowering_now().rows`; `_sfa_source`): where those rows' lists name more keys than the
      caches hold, the caches as they are -- this call's T rows, then every slot's ring, then
      every slot's compressed entries -- and no query's keys are gathered (a prefill);
      otherwise each query's own keys gathered (`T x (W + K)` rows, fewer than the caches: a
      decode step). Either decoded to the queries' dtype (FP8 rows by `npu_anti_mx_quant`,
      FP4 rows by their e4m3 scales per 16);
    - the per-head sink as `sinks` (in the softmax's denominator); scale `d^-0.5`;
    - one query more than the call's (its list all -1, its output dropped), and with the keys
      gathered one source row more: the kernel refuses an empty query or key, which a DP
      group without tokens (T = 0) would hand it.

    What it does not keep: the official numerics' blockwise bf16 rounding of the probabilities
    (`model.attention.blockwise_sink_attention`): the kernel's softmax is its own."""
    q_val = q.node.meta["val"]
    d, dtype, device = int(q_val.shape[2]), q_val.dtype, q_val.device
    window = int(window)
    T = aten.sym_size.int(q, 0)
    slots = int(ring.node.meta["val"].shape[0])
    entries = 0 if compressed is None else int(compressed.node.meta["val"].shape[1])
    n = window + (0 if idx is None else int(idx.node.meta["val"].shape[1]))

    def arange(end: Any) -> Proxy:
        return emit.call(aten.arange.default, end, dtype=torch.int64, device=device)

    tokens, slot_n = arange(T), arange(n)
    kv_rows = cast(kv, kv.node.meta["val"].dtype, dtype)

    def decoded(rows: Proxy, cache: Proxy, lead: list[int], fp8: bool, fp4: bool) -> Proxy:
        """`rows` of `cache` (leading dims `lead`, -1 for T) as `dtype` values."""
        if fp8:
            return _fp8_rows_decoded(rows, lead, d, dtype)
        if fp4:
            return fp4_rows_decoded(emit, rows, lead, d, dtype, device)
        return cast(rows, cache.node.meta["val"].dtype, dtype)

    back = aten.sub.Tensor(arange(window), window - 1)  # [W]: -(W-1) .. 0
    key_pos = aten.add.Tensor(aten.unsqueeze.default(positions, 1), back)  # [T, W]
    in_call = aten.ge.Tensor(key_pos, aten.unsqueeze.default(start, 1))
    call_row = aten.clamp_min.default(aten.add.Tensor(aten.unsqueeze.default(tokens, 1), back), 0)
    ring_pos = aten.remainder.Scalar(aten.clamp_min.default(key_pos, 0), window)
    slot_1 = aten.unsqueeze.default(slot, 1)
    visible = aten.ge.Scalar(key_pos, 0)
    if compressed is not None:
        visible = aten.cat.default([visible, picked], 1)
    rows = (lowering_now() or Lowered("", "")).rows  # outside a compile: the default workload
    whole, why = _sfa_source(rows, n, slots, window, entries)
    if whole:  # the caches as they are: this call's rows, every ring, every compressed entry
        parts = [kv_rows]
        parts.append(
            aten.view.default(decoded(ring, ring, [slots, window], ring_fp8, False), [-1, d])
        )
        ring_row = aten.add.Tensor(aten.add.Tensor(aten.mul.Scalar(slot_1, window), T), ring_pos)
        index = aten.where.self(in_call, call_row, ring_row)
        if compressed is not None:
            entry_rows = decoded(compressed, compressed, [slots, entries], False, compressed_fp4)
            parts.append(aten.view.default(entry_rows, [-1, d]))
            first = aten.add.Tensor(aten.mul.Scalar(slot_1, entries), slots * window)
            index = aten.cat.default([index, aten.add.Tensor(aten.add.Tensor(first, T), idx)], 1)
        source = aten.cat.default(parts)
    else:  # each query's keys gathered: row s of query t at t * n + s
        ring_rows = aten.index.Tensor(ring, [slot_1, ring_pos])
        ring_keys = decoded(ring_rows, ring, [-1, window], ring_fp8, False)
        call_keys = aten.index.Tensor(kv_rows, [call_row])
        keys = aten.where.self(aten.unsqueeze.default(in_call, -1), call_keys, ring_keys)
        if compressed is not None:
            picked_rows = aten.index.Tensor(compressed, [slot_1, idx])
            picks = decoded(picked_rows, compressed, [-1, n - window], False, compressed_fp4)
            keys = aten.cat.default([keys, picks], 1)
        # and a row of zeros no list names: the kernel refuses an empty key (T = 0)
        source = aten.constant_pad_nd.default(aten.view.default(keys, [-1, d]), [0, 0, 0, 1])
        index = aten.add.Tensor(aten.mul.Scalar(aten.unsqueeze.default(tokens, 1), n), slot_n)
    source = emit.named(source, "sfa_source", why)
    # the visible keys first, in their order: tie-free keys (graph mode has no stable sort)
    key = aten.where.self(visible, slot_n, aten.add.Tensor(slot_n, n))
    order = aten.sort.default(key, -1)[1]
    index = aten.gather.default(index, 1, order)
    visible = aten.gather.default(visible, 1, order)
    none = emit.call(aten.scalar_tensor.default, -1, dtype=torch.int64, device=device)
    index = aten._to_copy.default(aten.where.self(visible, index, none), dtype=torch.int32)
    # one query more: the kernel refuses an empty one
    query = aten.constant_pad_nd.default(q, [0, 0, 0, 0, 0, 1], 0.0)
    index = aten.constant_pad_nd.default(index, [0, 0, 0, 1], -1)
    key_value = aten.view.default(source, [1, -1, 1, d])
    out = npu_op("npu_sparse_flash_attention")(
        aten.unsqueeze.default(query, 0),
        key_value,
        key_value,
        aten.view.default(index, [1, -1, 1, n]),
        d**-0.5,
        sparse_block_size=1,
        layout_query="BSND",
        layout_kv="BSND",
        sparse_mode=0,
        attention_mode=0,
        sinks=sink,
    )[0]
    return aten.slice.Tensor(aten.select.int(out, 0, 0), 0, 0, T)


def _sfa_source(rows: int, keys: int, slots: int, window: int, entries: int) -> tuple[bool, str]:
    """Whether `sparse_attention_sfa` reads the caches as they are (True) or each query's keys
    gathered, and why: the fewer rows to decode and copy, at `rows` queries of `keys` keys
    against `slots` rings of `window` rows and `slots` x `entries` compressed entries."""
    listed, held = rows * keys, slots * (window + entries)
    whole = listed >= held
    source = "the caches as they are" if whole else "each query's keys gathered"
    return whole, (
        f"npu_sparse_flash_attention's KV source: {source} ({rows} rows_per_step x {keys} "
        f"keys = {listed:,} rows listed; the caches hold {held:,})"
    )


def fp4_rows_decoded(
    emit, rows: Proxy, lead: list[int], d: int, dtype: torch.dtype, device: torch.device
) -> Proxy:
    """The compressed KV's FP4 rows (`model.numerics.fp4_rows`: d / 2 bytes of e2m1 pairs, low
    nibble first, then d / 16 e4m3 scales) as `dtype` values, as the model decodes them: each
    byte's two values looked up in a table of the 256 bytes (`formats.e2m1_table`, computed in
    the graph from the codes' bits), times their block's scale, in fp32."""
    half, blocks = d // 2, d // KV_FP4_BLOCK
    packed = aten.slice.Tensor(rows, -1, 0, half)
    scales = aten.view.dtype(aten.slice.Tensor(rows, -1, half, half + blocks), torch.float8_e4m3fn)
    table = e2m1_table(emit.call(aten.arange.default, 256, dtype=torch.int64, device=device))
    index = aten._to_copy.default(aten.view.dtype(packed, torch.uint8), dtype=torch.int64)
    value = aten.view.default(aten.index.Tensor(table, [index]), [*lead, d])
    scaled = aten.mul.Tensor(
        aten.unflatten.int(value, -1, [blocks, KV_FP4_BLOCK]),
        aten.unsqueeze.default(aten._to_copy.default(scales, dtype=torch.float32), -1),
    )
    return aten._to_copy.default(aten.flatten.using_ints(scaled, -2), dtype=dtype)
