"""DeepSeek V4.1's routed experts in graph mode (`deepseek_v41/graph_mode.py`): through
torch_npu's grouped matmul (its CPU stand-in here), against the reference kernel."""

from __future__ import annotations

import pytest
import torch

from dsv41_compile.deepseek_v41.adapter import DEEPSEEK_V41
from dsv41_compile.deepseek_v41.graph_mode import grouped_matmul
from dsv41_compile.deepseek_v41.model.ops import routed_experts
from dsv41_compile.testing.graphs import rewritten_for_graph_mode
from dsv41_compile.testing.torchair_standin import register_npu_ops

g = torch.Generator().manual_seed(0)
register_npu_ops()  # torch_npu's grouped matmul: schema + CPU kernel of the form graph mode uses


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("limit", [0.0, 0.5])
def test_routed_experts_through_the_grouped_matmul_match_the_kernel(dtype, atol, limit):
    T, K, E, I, D = 12, 3, 4, 8, 16
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[[2, 7]] = -1  # padding rows: routed nowhere
    idx[0, 1] = -1  # and one unassigned pick of a real row
    weight = torch.rand(T, K, generator=g)
    args = (randn(T, D, dtype=dtype), idx, weight)
    experts = tuple(randn(*shape, dtype=dtype) for shape in ((E, I, D), (E, D, I), (E, I, D)))
    gm, tensors = rewritten_for_graph_mode(
        torch.ops.dsv41.routed_experts.default, *args, *experts, limit,
        rewrites=DEEPSEEK_V41.graph_mode_rewrites,
    )  # fmt: skip
    assert gm.graph.find_nodes(op="call_function", target=grouped_matmul())
    got = gm(*tensors)
    torch.testing.assert_close(got, routed_experts(*args, *experts, limit), atol=atol, rtol=1e-2)
    assert got[[2, 7]].abs().max() == 0  # (the stand-in kernel leaves NaN past the groups)


def test_grouped_matmul_stand_in_is_the_documented_form_only():
    x, w, counts = randn(6, 4), randn(2, 4, 3), torch.tensor([2, 3])
    (out,) = grouped_matmul()([x], [w], group_list=counts, split_item=3, group_type=0,
                              group_list_type=1)  # fmt: skip
    torch.testing.assert_close(out[:5], torch.cat([x[:2] @ w[0], x[2:5] @ w[1]]))
    assert out[5].isnan().all()  # past the last group: not written
    with pytest.raises(ValueError, match="implements one form"):
        grouped_matmul()([x], [w], group_list=counts.cumsum(0), split_item=3, group_type=0,
                         group_list_type=0)  # fmt: skip


def test_engram_lookup_through_gathered_bytes_matches_the_op():
    """Graph mode gathers the rows' bytes and dequantises them with the op's own arithmetic."""
    from dsv41_compile.deepseek_v41.model.ops import engram_lookup
    from dsv41_compile.deepseek_v41.model.quant import quantize_fp8

    table, scale = quantize_fp8(randn(40, 64) * 3, rows=1)
    rows = torch.randint(0, 40, (5, 3), generator=g)
    columns = [0, 10, 25, 40]
    gm, tensors = rewritten_for_graph_mode(
        torch.ops.dsv41.engram_lookup.default, table, scale, rows, columns, torch.float32,
        rewrites=DEEPSEEK_V41.graph_mode_rewrites,
    )  # fmt: skip
    expected = engram_lookup(table, scale, rows, columns, torch.float32)
    torch.testing.assert_close(gm(*tensors), expected, atol=0, rtol=0)
