"""DeepSeek V4.1's routed experts in graph mode (`lowering="torchair"`): the rewrite
`targets.graph_mode` applies to `dsv41::routed_experts`, through torch_npu's
`npu_grouped_matmul` (registered when torch_npu is imported; on CPU by
`testing.torchair_standin.register_npu_ops`)."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Proxy

from dsv41_compile.core.emitter import cast
from dsv41_compile.model.ops import clamped_swiglu, engram_dequantize

__all__ = [
    "act_quant_dequant_refused",
    "engram_lookup_gathered",
    "fp8_weight_decoded",
    "grouped_matmul",
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
    emit, val, x, topk_idx, topk_weight, w1, w2, w3, swiglu_limit, fp8_hidden=False
):
    """`dsv41::routed_experts` for graph mode: the (row, k) assignments sorted by expert,
    torch_npu's grouped matmul for w1 / w3 / w2 with the rows per expert as groups, the clamped
    SwiGLU and the routing weight in fp32, `index_add` back to the rows in expert order (the
    reference kernel's order). Static sizes, no host read, no E x FLOPs; unassigned rows are
    sorted past the last group (what the kernel leaves there is not documented: zeroed before
    the sum). The official numerics' FP8 quantisation of the hidden activation (`fp8_hidden`)
    has no graph-mode form yet: an error, not a program that skips it."""
    if fp8_hidden:
        raise NotImplementedError(
            "lowering='torchair' does not yet quantise the routed experts' hidden activation "
            "as numerics='official' does (FP8 per 32 values before w2): compile with "
            "lowering='eager' or 'inductor', or a model with numerics='bf16'"
        )
    n_experts = w1.node.meta["val"].shape[0]
    dtype = x.node.meta["val"].dtype
    top_k = topk_idx.node.meta["val"].shape[1]
    experts = emit.call(aten.arange.default, n_experts, dtype=torch.int64, device=val.device)
    none = emit.call(aten.scalar_tensor.default, n_experts, dtype=torch.int64, device=val.device)
    # The (row, k) assignments in expert order, unassigned ones (-1) last under key E.
    expert = aten.view.default(topk_idx, [-1])
    key = aten.where.self(aten.ge.Scalar(expert, 0), expert, none)
    ordered = aten.sort.default(key)
    sorted_key, order = ordered[0], ordered[1]
    row = aten.floor_divide.default(order, top_k)
    rows = aten.index_select.default(x, 0, row)
    weight = aten.index_select.default(aten.view.default(topk_weight, [-1]), 0, order)
    counts = aten.sum.dim_IntList(
        aten.eq.Tensor(aten.unsqueeze.default(sorted_key, 1), experts), [0]
    )  # rows per expert: the groups
    gate = cast(_grouped(rows, w1, counts), dtype, torch.float32)
    up = cast(_grouped(rows, w3, counts), dtype, torch.float32)
    h = aten.mul.Tensor(clamped_swiglu(gate, up, swiglu_limit), aten.unsqueeze.default(weight, 1))
    y = cast(_grouped(cast(h, torch.float32, dtype), w2, counts), dtype, torch.float32)
    # rows past the last group (unassigned) are not defined by the kernel: zeroed, never read
    assigned = aten.unsqueeze.default(aten.lt.Scalar(sorted_key, n_experts), 1)
    zero = emit.call(aten.scalar_tensor.default, 0.0, dtype=torch.float32, device=val.device)
    y = aten.where.self(assigned, y, zero)
    # each row's outputs added in fp32 in expert order (the order they come in): the kernel's
    return aten.index_add.default(aten.zeros_like.default(x, dtype=torch.float32), 0, row, y)


def act_quant_dequant_refused(emit, val, *args):
    """`dsv41::act_quant_dequant` (numerics="official") has no graph-mode form yet: an error
    saying what compiles."""
    raise NotImplementedError(
        "lowering='torchair' does not yet quantise activations as numerics='official' does "
        "(FP8 per 32 values before each FP8 GEMM): compile with lowering='eager' or "
        "'inductor', or a model with numerics='bf16'"
    )


def fp8_weight_decoded(emit, val, *args):
    """`dsv41::fp8_weight` has no graph-mode form yet (torch_npu's quantised matmul with e8m0
    block scales is not mapped): an error saying what compiles."""
    raise NotImplementedError(
        "lowering='torchair' does not yet run the FP8 linears with their weights as released "
        "(e4m3 codes and e8m0 block scales, weight_format='released'): compile with "
        "lowering='eager' or 'inductor', or a model with weight_format='dequantized'"
    )


def routed_experts_fp4_grouped(emit, val, *args):
    """`dsv41::routed_experts_fp4` has no graph-mode form yet (torch_npu's grouped matmul with
    FP4 weights and their e8m0 scales is not mapped): an error saying what compiles, not a
    program that decodes every expert's weights on every call."""
    raise NotImplementedError(
        "lowering='torchair' does not yet run the routed experts with their weights as "
        "released (FP4 codes and e8m0 scales, weight_format='released'): compile with "
        "lowering='eager' or 'inductor', or a model with weight_format='dequantized'"
    )


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
    """torch_npu's `npu_grouped_matmul` (registered when torch_npu is imported; on CPU by
    `testing.torchair_standin.register_npu_ops`)."""
    if not hasattr(torch.ops.npu, "npu_grouped_matmul"):
        raise ValueError(
            "graph mode computes the routed experts with torch_npu's npu_grouped_matmul, which "
            "is not registered: import torch_npu first (lowering='torchair' does), or on CPU "
            "call dsv41_compile.testing.torchair_standin.register_npu_ops()"
        )
    return torch.ops.npu.npu_grouped_matmul.default
