"""Expert parallelism on a fake 8-rank process group: the rewritten MoE block, the expert
shards, the statistics outputs, padding rows. (Numerics with real processes:
test_backend_numerics.)"""

from __future__ import annotations

import json
from collections import Counter

import expecttest
import pytest
import torch
from test_backend_graph import compile_on_fake_rank, layer_text

from dsv41_compile.collectives.expert_parallel import EpLayer
from dsv41_compile.fx_utils import REGION
from dsv41_compile.model import ModelConfig
from dsv41_compile.propagation.plan import ExpertShard
from dsv41_compile.testing.batches import Request
from dsv41_compile.validate import collective_kind

aten = torch.ops.aten
TINY_SWA = ModelConfig.from_name("tiny-swa")  # 16 experts, top-6: 2 experts per rank at ep=8


def ep_options(dispatch: str, **extra) -> dict:
    return {"tp": 4, "ep": 8, "ep_dispatch": dispatch, **extra}


@pytest.fixture(scope="module")
def exact_rank5():
    return compile_on_fake_rank(5, ep_options("exact"))


@pytest.fixture(scope="module")
def padded_rank2():
    return compile_on_fake_rank(2, ep_options("padded"))


def collectives_by_region(gm, ctx) -> Counter:
    counts = Counter()
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind:
            axis = "ep" if node.args[-1] == ctx.mesh.ep_group_name else "tp"
            counts[(node.meta[REGION], kind, axis)] += 1
    return counts


@pytest.mark.parametrize(("fixture", "a2a"), [("exact_rank5", 4), ("padded_rank2", 3)])
def test_moe_halves_talk_only_over_ep_and_attention_only_over_tp(fixture, a2a, request):
    gm, ctx, logits = request.getfixturevalue(fixture)
    assert logits.shape == (8, 512)
    assert collectives_by_region(gm, ctx) == {
        ("layers.0.attn", "all_gather", "tp"): 1,
        ("layers.0", "reduce_scatter", "tp"): 1,  # the partial of wo_b, at the residual add
        ("layers.0.ffn", "all_to_all", "ep"): a2a,  # (counts,) rows, routes, combine
        ("layers.1.attn", "all_gather", "tp"): 1,
        ("layers.1", "reduce_scatter", "tp"): 1,
        ("layers.1.ffn", "all_to_all", "ep"): a2a,
        ("head", "all_gather", "tp"): 1,
    }
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.dsv41.routed_experts.default
                and n.args[3].op == "placeholder" and "ep_local" not in n.name]  # fmt: skip


@pytest.mark.parametrize("fixture", ["exact_rank5", "padded_rank2"])
def test_each_rank_holds_its_own_slice_of_the_experts(fixture, request):
    gm, ctx, _ = request.getfixturevalue(fixture)
    rank = ctx.mesh.rank
    experts = {s.fqn: s for s in ctx.param_shards.values() if isinstance(s.placement, ExpertShard)}
    assert sorted(experts) == [
        f"layers.{i}.ffn.experts.{w}" for i in range(2) for w in ("w1", "w2", "w3")
    ]
    assert {(s.dim, s.parts, s.index) for s in experts.values()} == {(0, 8, rank)}
    local = [n for n in gm.graph.nodes if n.name.startswith("ep_local_experts")]
    assert [n.args[3].meta["val"].shape for n in local] == [torch.Size([2, 32, 64])] * 2
    assert [layer.layer for layer in ctx.ep_layers] == [0, 1]


def test_padded_dispatch_has_no_host_read_and_a_static_capacity(padded_rank2):
    gm, ctx, _ = padded_rank2
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert aten._local_scalar_dense.default not in targets
    assert aten.sym_constrain_range_for_size.default not in targets
    a2a = [n for n in gm.graph.nodes if collective_kind(n) == "all_to_all"]
    for node in a2a:  # every peer gets C = Tl_max * min(K, E/ep) = 2 * Tl_max rows
        assert len(set(node.args[1])) == 1 and node.args[1] == node.args[2]
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert placeholders[-2:] == ["tp_rank", "ep_tokens"]


def test_exact_dispatch_reads_the_counts_once_per_layer(exact_rank5):
    gm, _, _ = exact_rank5
    reads = [n for n in gm.graph.nodes if n.target is aten._local_scalar_dense.default]
    assert len(reads) == 2 * 16  # 8 send + 8 receive counts per MoE layer


def test_statistics_are_extra_graph_outputs(exact_rank5):
    gm, _, _ = exact_rank5
    outputs = gm.graph.output_node().args[0]
    assert [n.name for n in outputs[-2:]] == ["ep_stats", "ep_stats_1"]
    assert [tuple(n.meta["val"].shape) for n in outputs[-2:]] == [(2, 8)] * 2


@pytest.mark.parametrize("dispatch", ["exact", "padded"])
def test_padding_rows_route_nothing(dispatch, tmp_path):
    """T = 10 over tp = 4 (Tl = 3, two SP tail-padding rows on tp_rank 3) with rows 8 and 9
    slot -1: tp_rank 2 holds rows 6, 7 (valid) and 8 (padding) -> 2 * 6 assignments; tp_rank 3
    holds row 9 and the SP padding -> none. The counts are this rank's own routing, so the
    fake process group shows them."""
    requests = [Request(0, [1, 2, 3, 4, 5, 6, 7, 8], 0), Request(-1, [0, 0], 0)]
    sent = {}
    for rank in (2, 3):
        compile_on_fake_rank(
            rank, ep_options(dispatch, dump_dir=str(tmp_path)),
            requests=requests,
        )  # fmt: skip
        comm = json.loads((tmp_path / f"rank{rank}" / "comm.json").read_text())
        (call,) = comm["ep_steps"]
        sent[rank] = [layer["assignments_sent"] for layer in call["layers"]]
    assert sent == {2: [12, 12], 3: [0, 0]}


def test_step_record_bytes_by_hand():
    layer = EpLayer(
        layer=0, region="layers.0.ffn", dispatch="exact", ep=4, rank=1, experts_per_rank=2,
        top_k=3, token_row_bytes=64 * 2,
    )  # fmt: skip
    stats = torch.tensor([[2, 5, 0, 1], [3, 4, 1, 0]])
    record = layer.step_record(stats, ep_tokens=3)
    assert record["assignments_sent"] == 8 and record["assignments_received"] == 8
    # to peers 0, 2, 3: 3 rows of (128 + 8) bytes, plus 3 counts of 8 bytes
    assert record["dispatch_bytes_sent"] == 3 * 136 + 3 * 8
    assert record["combine_bytes_sent"] == (3 + 1 + 0) * 128  # rows received from peers
    padded = EpLayer(**{**layer.__dict__, "dispatch": "padded"}).step_record(stats, ep_tokens=3)
    # C = 3 tokens * min(3, 2) rows per peer, 3 peers
    assert padded["dispatch_bytes_sent"] == 3 * 6 * 136
    assert padded["combine_bytes_sent"] == 3 * 6 * 128
    assert padded["valid_dispatch_bytes_sent"] == 3 * 136
    assert padded["valid_combine_bytes_sent"] == 4 * 128


class TestMoeSnapshot(expecttest.TestCase):
    def test_moe_block_of_layer_0_exact_dispatch(self):
        """Gate on the local token shard, dispatch (count exchange, host read of the splits,
        rows and routes), this rank's two experts, combine, fp32 sum at the source, shared
        expert on the local rows. No TP collective, no all-reduce."""
        gm, ctx, _ = compile_on_fake_rank(5, ep_options("exact"))
        self.assertExpectedInline(
            layer_text(gm, ctx, 0, ".ffn"),
            """\
t_6 = t(layers.0.ffn.gate.weight)  # R f32[64, 16]
mm_6 = mm(mul_1034, t_6)  # S(0) f32[((T+3)//4), 16]
softplus = softplus(mm_6)  # S(0) f32[((T+3)//4), 16]
sqrt = sqrt(softplus)  # S(0) f32[((T+3)//4), 16]
add_1889 = add(sqrt, layers.0.ffn.gate.bias)  # S(0) f32[((T+3)//4), 16]
topk = topk(add_1889, 6)  # (S(0), S(0)) (f32[((T+3)//4), 6], i64[((T+3)//4), 6])
getitem_7 = getitem(topk, 1)  # S(0) i64[((T+3)//4), 6]
gather = gather(sqrt, 1, getitem_7)  # S(0) f32[((T+3)//4), 6]
sum_81 = sum(gather, [-1], True)  # S(0) f32[((T+3)//4), 1]
add_1905 = add(sum_81, 1e-20)  # S(0) f32[((T+3)//4), 1]
div_78 = div(gather, add_1905)  # S(0) f32[((T+3)//4), 6]
mul_1055 = mul(div_78, 1.5)  # S(0) f32[((T+3)//4), 6]
constant_pad_nd_default_3 = constant_pad_nd(ge_3, [0, sub_1052], 0)  # b8[4*(((T+3)//4))]
unflatten_int_2 = unflatten(constant_pad_nd_default_3, 0, [4, -1])  # b8[4, ((T+3)//4)]
index_tensor_2 = index(unflatten_int_2, [tp_rank])  # S(0) b8[((T+3)//4)]
slice_37 = slice(index_tensor_2, 0, 0, end)  # S(0) b8[((T+3)//4)]
unsqueeze_25 = unsqueeze(slice_37, 1)  # S(0) b8[((T+3)//4), 1]
scalar_tensor_1 = scalar_tensor(-1, dtype=i64, layout=torch.strided)  # R i64[]
where_1 = where(unsqueeze_25, getitem_7, scalar_tensor_1)  # S(0) i64[((T+3)//4), 6]
slice_38 = slice(index_tensor_2, 0, 0, end)  # S(0) b8[((T+3)//4)]
unsqueeze_26 = unsqueeze(slice_38, 1)  # S(0) b8[((T+3)//4), 1]
scalar_tensor_2 = scalar_tensor(0.0, dtype=f32, layout=torch.strided)  # R f32[]
where_2 = where(unsqueeze_26, mul_1055, scalar_tensor_2)  # S(0) f32[((T+3)//4), 6]
view_default = view(where_1, [-1])  # i64[6*(((T+3)//4))]
ge_scalar = ge(view_default, 0)  # b8[6*(((T+3)//4))]
where_scalar_other = where(ge_scalar, view_default, 16)  # i64[6*(((T+3)//4))]
sort_stable = sort(where_scalar_other, stable=True)  # (i64[6*(((T+3)//4))], i64[6*(((T+3)//4))])
getitem_19 = getitem(sort_stable, 0)  # i64[6*(((T+3)//4))]
getitem_20 = getitem(sort_stable, 1)  # i64[6*(((T+3)//4))]
ep_dest = floor_divide(getitem_19, 2)  # i64[6*(((T+3)//4))]
unsqueeze_default = unsqueeze(ep_dest, 1)  # i64[6*(((T+3)//4)), 1]
arange_default = arange(8, dtype=i64)  # i64[8]
eq_tensor = eq(unsqueeze_default, arange_default)  # b8[6*(((T+3)//4)), 8]
ep_sent = sum(eq_tensor, [0])  # i64[8]
all_to_all_single_default = _c10d_functional.all_to_all_single(ep_sent, [1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1], 'ep')  # i64[8]
ep_received = _c10d_functional.wait_tensor(all_to_all_single_default)  # i64[8]  <- EP count exchange: how many assignments each rank sends this rank
cat_default = cat([ep_sent, ep_received])  # i64[16]
unbind_int = unbind(cat_default)  # (i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[])
getitem_21 = getitem(unbind_int, 0)  # i64[]
ep_send_0 = _local_scalar_dense(getitem_21)  # u3
sym_constrain_range_for_size_default = sym_constrain_range_for_size(ep_send_0)
getitem_22 = getitem(unbind_int, 1)  # i64[]
ep_send_1 = _local_scalar_dense(getitem_22)  # u4
sym_constrain_range_for_size_default_1 = sym_constrain_range_for_size(ep_send_1)
getitem_23 = getitem(unbind_int, 2)  # i64[]
ep_send_2 = _local_scalar_dense(getitem_23)  # u5
sym_constrain_range_for_size_default_2 = sym_constrain_range_for_size(ep_send_2)
getitem_24 = getitem(unbind_int, 3)  # i64[]
ep_send_3 = _local_scalar_dense(getitem_24)  # u6
sym_constrain_range_for_size_default_3 = sym_constrain_range_for_size(ep_send_3)
getitem_25 = getitem(unbind_int, 4)  # i64[]
ep_send_4 = _local_scalar_dense(getitem_25)  # u7
sym_constrain_range_for_size_default_4 = sym_constrain_range_for_size(ep_send_4)
getitem_26 = getitem(unbind_int, 5)  # i64[]
ep_send_5 = _local_scalar_dense(getitem_26)  # u8
sym_constrain_range_for_size_default_5 = sym_constrain_range_for_size(ep_send_5)
getitem_27 = getitem(unbind_int, 6)  # i64[]
ep_send_6 = _local_scalar_dense(getitem_27)  # u9
sym_constrain_range_for_size_default_6 = sym_constrain_range_for_size(ep_send_6)
getitem_28 = getitem(unbind_int, 7)  # i64[]
ep_send_7 = _local_scalar_dense(getitem_28)  # u10
sym_constrain_range_for_size_default_7 = sym_constrain_range_for_size(ep_send_7)
getitem_29 = getitem(unbind_int, 8)  # i64[]
ep_recv_0 = _local_scalar_dense(getitem_29)  # u11
sym_constrain_range_for_size_default_8 = sym_constrain_range_for_size(ep_recv_0)
getitem_30 = getitem(unbind_int, 9)  # i64[]
ep_recv_1 = _local_scalar_dense(getitem_30)  # u12
sym_constrain_range_for_size_default_9 = sym_constrain_range_for_size(ep_recv_1)
getitem_31 = getitem(unbind_int, 10)  # i64[]
ep_recv_2 = _local_scalar_dense(getitem_31)  # u13
sym_constrain_range_for_size_default_10 = sym_constrain_range_for_size(ep_recv_2)
getitem_32 = getitem(unbind_int, 11)  # i64[]
ep_recv_3 = _local_scalar_dense(getitem_32)  # u14
sym_constrain_range_for_size_default_11 = sym_constrain_range_for_size(ep_recv_3)
getitem_33 = getitem(unbind_int, 12)  # i64[]
ep_recv_4 = _local_scalar_dense(getitem_33)  # u15
sym_constrain_range_for_size_default_12 = sym_constrain_range_for_size(ep_recv_4)
getitem_34 = getitem(unbind_int, 13)  # i64[]
ep_recv_5 = _local_scalar_dense(getitem_34)  # u16
sym_constrain_range_for_size_default_13 = sym_constrain_range_for_size(ep_recv_5)
getitem_35 = getitem(unbind_int, 14)  # i64[]
ep_recv_6 = _local_scalar_dense(getitem_35)  # u17
sym_constrain_range_for_size_default_14 = sym_constrain_range_for_size(ep_recv_6)
getitem_36 = getitem(unbind_int, 15)  # i64[]
ep_recv_7 = _local_scalar_dense(getitem_36)  # u18
sym_constrain_range_for_size_default_15 = sym_constrain_range_for_size(ep_recv_7)
add_4095 = ep_send_0 + ep_send_1  # u3+u4
add_4096 = add_4095 + ep_send_2  # u3+u4+u5
add_4097 = add_4096 + ep_send_3  # u3+u4+u5+u6
add_4098 = add_4097 + ep_send_4  # u3+u4+u5+u6+u7
add_4099 = add_4098 + ep_send_5  # u3+u4+u5+u6+u7+u8
add_4100 = add_4099 + ep_send_6  # u3+u4+u5+u6+u7+u8+u9
add_4101 = add_4100 + ep_send_7  # u10+u3+u4+u5+u6+u7+u8+u9
ep_assignment = narrow(getitem_20, 0, 0, add_4101)  # i64[u10+u3+u4+u5+u6+u7+u8+u9]
ep_token = floor_divide(ep_assignment, 6)  # i64[u10+u3+u4+u5+u6+u7+u8+u9]
narrow_default_1 = narrow(getitem_19, 0, 0, add_4101)  # i64[u10+u3+u4+u5+u6+u7+u8+u9]
remainder_scalar = remainder(narrow_default_1, 2)  # i64[u10+u3+u4+u5+u6+u7+u8+u9]
view_default_1 = view(where_2, [-1])  # f32[6*(((T+3)//4))]
index_select_default = index_select(view_default_1, 0, ep_assignment)  # f32[u10+u3+u4+u5+u6+u7+u8+u9]
_to_copy_default = _to_copy(remainder_scalar, dtype=f32)  # f32[u10+u3+u4+u5+u6+u7+u8+u9]
stack_default = stack([_to_copy_default, index_select_default], 1)  # f32[u10+u3+u4+u5+u6+u7+u8+u9, 2]
index_select_default_1 = index_select(mul_1034, 0, ep_token)  # f32[u10+u3+u4+u5+u6+u7+u8+u9, 64]
all_to_all_single_default_1 = _c10d_functional.all_to_all_single(index_select_default_1, [ep_recv_0, ep_recv_1, ep_recv_2, ep_recv_3, ep_recv_4, ep_recv_5, ep_recv_6, ep_recv_7], [ep_send_0, ep_send_1, ep_send_2, ep_send_3, ep_send_4, ep_send_5, ep_send_6, ep_send_7], 'ep')  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 64]
ep_rows = _c10d_functional.wait_tensor(all_to_all_single_default_1)  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 64]  <- EP dispatch: each assignment's token row to the rank of its expert
all_to_all_single_default_2 = _c10d_functional.all_to_all_single(stack_default, [ep_recv_0, ep_recv_1, ep_recv_2, ep_recv_3, ep_recv_4, ep_recv_5, ep_recv_6, ep_recv_7], [ep_send_0, ep_send_1, ep_send_2, ep_send_3, ep_send_4, ep_send_5, ep_send_6, ep_send_7], 'ep')  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 2]
ep_routes = _c10d_functional.wait_tensor(all_to_all_single_default_2)  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 2]  <- EP dispatch: each assignment's local expert index and routing weight
select_int = select(ep_routes, 1, 0)  # f32[u11+u12+u13+u14+u15+u16+u17+u18]
_to_copy_default_1 = _to_copy(select_int, dtype=i64)  # i64[u11+u12+u13+u14+u15+u16+u17+u18]
select_int_1 = select(ep_routes, 1, 1)  # f32[u11+u12+u13+u14+u15+u16+u17+u18]
unsqueeze_default_1 = unsqueeze(_to_copy_default_1, 1)  # i64[u11+u12+u13+u14+u15+u16+u17+u18, 1]
unsqueeze_default_2 = unsqueeze(select_int_1, 1)  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 1]
ep_local_experts = dsv41.routed_experts(ep_rows, unsqueeze_default_1, unsqueeze_default_2, layers.0.ffn.experts.w1, layers.0.ffn.experts.w2, layers.0.ffn.experts.w3, 10.0)  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 64]
all_to_all_single_default_3 = _c10d_functional.all_to_all_single(ep_local_experts, [ep_send_0, ep_send_1, ep_send_2, ep_send_3, ep_send_4, ep_send_5, ep_send_6, ep_send_7], [ep_recv_0, ep_recv_1, ep_recv_2, ep_recv_3, ep_recv_4, ep_recv_5, ep_recv_6, ep_recv_7], 'ep')  # f32[u10+u3+u4+u5+u6+u7+u8+u9, 64]
ep_combined = _c10d_functional.wait_tensor(all_to_all_single_default_3)  # f32[u10+u3+u4+u5+u6+u7+u8+u9, 64]  <- EP combine: weighted expert outputs back to their source rank
zeros_like_default = zeros_like(mul_1034, dtype=f32)  # f32[((T+3)//4), 64]
ep_routed_out = index_add(zeros_like_default, 0, ep_token, ep_combined)  # S(0) f32[((T+3)//4), 64]
ep_stats = stack([ep_sent, ep_received])  # i64[2, 8]
t_7 = t(layers.0.ffn.shared_expert.w1.weight)  # R f32[64, 32]
mm_7 = mm(mul_1034, t_7)  # S(0) f32[((T+3)//4), 32]
t_8 = t(layers.0.ffn.shared_expert.w3.weight)  # R f32[64, 32]
mm_8 = mm(mul_1034, t_8)  # S(0) f32[((T+3)//4), 32]
clamp_1 = clamp(mm_8, -10.0, 10.0)  # S(0) f32[((T+3)//4), 32]
clamp_2 = clamp(mm_7, None, 10.0)  # S(0) f32[((T+3)//4), 32]
silu = silu(clamp_2)  # S(0) f32[((T+3)//4), 32]
mul_1074 = mul(silu, clamp_1)  # S(0) f32[((T+3)//4), 32]
t_9 = t(layers.0.ffn.shared_expert.w2.weight)  # R f32[32, 64]
mm_9 = mm(mul_1074, t_9)  # S(0) f32[((T+3)//4), 64]
add_1955 = add(ep_routed_out, mm_9)  # S(0) f32[((T+3)//4), 64]""",
        )
