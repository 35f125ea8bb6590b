"""Expert parallelism on a fake 8-rank process group: the rewritten MoE block, the expert
shards, the statistics outputs, padding rows. (Numerics with real processes:
tests/distributed/test_numerics.py.)"""

from __future__ import annotations

import json
from collections import Counter

import expecttest
import pytest
import torch

from dsv41_compile.core.meta import REGION
from dsv41_compile.moe.stats import EpLayer
from dsv41_compile.report.comm import collective_kind
from dsv41_compile.spmd.placements import ExpertShard
from dsv41_compile.testing.batches import Request
from dsv41_compile.testing.fake_rank import compile_on_fake_rank, layer_text, run_on_fake_rank
from dsv41_compile.testing.presets import ONE_LAYER, compile_config

aten = torch.ops.aten
TINY_SWA = compile_config()  # 16 experts, top-6: 2 experts per rank at ep=8


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
    assert {(s.dim, s.parts, s.axis) for s in experts.values()} == {(0, 8, "ep")}
    assert ctx.mesh.axis_rank("ep") == rank  # the shard the program slices (test_program)
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
    fake process group shows them. One MoE layer: the routing of a row does not depend on the
    layer. (Rank 3 runs the program rank 2 compiled: the host's compile cache.)"""
    requests = [Request(0, [1, 2, 3, 4, 5, 6, 7, 8], 0), Request(-1, [0, 0], 0)]
    sent = {}
    for rank in (2, 3):
        run_on_fake_rank(
            rank, ep_options(dispatch, dump_dir=str(tmp_path)),
            cfg=compile_config("tiny-swa", ONE_LAYER), requests=requests,
        )  # fmt: skip
        comm = json.loads((tmp_path / f"rank{rank}" / "comm.json").read_text())
        (call,) = comm["ep_steps"]
        sent[rank] = [layer["assignments_sent"] for layer in call["layers"]]
    assert sent == {2: [12], 3: [0]}


def test_step_record_bytes_by_hand():
    layer = EpLayer(
        layer=0, region="layers.0.ffn", dispatch="exact", ep=4, experts_per_rank=2, top_k=3,
        token_row_bytes=64 * 2,
    )  # fmt: skip
    stats = torch.tensor([[2, 5, 0, 1], [3, 4, 1, 0]])
    record = layer.step_record(stats, ep_tokens=3, rank=1)
    assert record["assignments_sent"] == 8 and record["assignments_received"] == 8
    # to peers 0, 2, 3: 3 rows of (128 + 8) bytes, plus 3 counts of 8 bytes
    assert record["dispatch_bytes_sent"] == 3 * 136 + 3 * 8
    assert record["combine_bytes_sent"] == (3 + 1 + 0) * 128  # rows received from peers
    padded = EpLayer(**{**layer.__dict__, "dispatch": "padded"}).step_record(stats, 3, rank=1)
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
            layer_text(gm, ctx, "layers.0.ffn"),
            """\
v0 = t(layers.0.ffn.gate.weight)  # R f32[64, 16]
v1 = mm(in0, v0)  # S(0) f32[((T+3)//4), 16]
v2 = softplus(v1)  # S(0) f32[((T+3)//4), 16]
v3 = sqrt(v2)  # S(0) f32[((T+3)//4), 16]
v4 = add(v3, layers.0.ffn.gate.bias)  # S(0) f32[((T+3)//4), 16]
v5 = topk(v4, 6)  # (S(0), S(0)) (f32[((T+3)//4), 6], i64[((T+3)//4), 6])
v6 = getitem(v5, 1)  # S(0) i64[((T+3)//4), 6]
v7 = gather(v3, 1, v6)  # S(0) f32[((T+3)//4), 6]
v8 = sum(v7, [-1], True)  # S(0) f32[((T+3)//4), 1]
v9 = add(v8, 1e-20)  # S(0) f32[((T+3)//4), 1]
v10 = div(v7, v9)  # S(0) f32[((T+3)//4), 6]
v11 = mul(v10, 1.5)  # S(0) f32[((T+3)//4), 6]
v12 = constant_pad_nd(in1, [0, in2], 0)  # b8[4*(((T+3)//4))]
v13 = unflatten(v12, 0, [4, in3])  # b8[4, ((T+3)//4)]
v14 = index(v13, [tp_rank])  # S(0) b8[((T+3)//4)]
v15 = slice(v14, 0, 0, end)  # S(0) b8[((T+3)//4)]
v16 = unsqueeze(v15, 1)  # S(0) b8[((T+3)//4), 1]
v17 = scalar_tensor(-1, dtype=i64, layout=torch.strided)  # R i64[]
v18 = where(v16, v6, v17)  # S(0) i64[((T+3)//4), 6]
v19 = slice(v14, 0, 0, end)  # S(0) b8[((T+3)//4)]
v20 = unsqueeze(v19, 1)  # S(0) b8[((T+3)//4), 1]
v21 = scalar_tensor(0.0, dtype=f32, layout=torch.strided)  # R f32[]
v22 = where(v20, v11, v21)  # S(0) f32[((T+3)//4), 6]
v23 = view(v18, [-1])  # i64[6*(((T+3)//4))]
v24 = ge(v23, 0)  # b8[6*(((T+3)//4))]
v25 = where(v24, v23, 16)  # i64[6*(((T+3)//4))]
v26 = sort(v25, stable=True)  # (i64[6*(((T+3)//4))], i64[6*(((T+3)//4))])
v27 = getitem(v26, 0)  # i64[6*(((T+3)//4))]
v28 = getitem(v26, 1)  # i64[6*(((T+3)//4))]
ep_dest = floor_divide(v27, 2)  # i64[6*(((T+3)//4))]
v29 = unsqueeze(ep_dest, 1)  # i64[6*(((T+3)//4)), 1]
v30 = arange(8, dtype=i64)  # i64[8]
v31 = eq(v29, v30)  # b8[6*(((T+3)//4)), 8]
ep_sent = sum(v31, [0])  # i64[8]
v32 = _c10d_functional.all_to_all_single(ep_sent, [1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1], 'ep')  # i64[8]
ep_received = _c10d_functional.wait_tensor(v32)  # i64[8]  <- EP count exchange: how many assignments each rank sends this rank
v33 = cat([ep_sent, ep_received])  # i64[16]
v34 = unbind(v33)  # (i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[])
v35 = getitem(v34, 0)  # i64[]
ep_send_0 = _local_scalar_dense(v35)  # u3
v36 = sym_constrain_range_for_size(ep_send_0)
v37 = getitem(v34, 1)  # i64[]
ep_send_1 = _local_scalar_dense(v37)  # u4
v38 = sym_constrain_range_for_size(ep_send_1)
v39 = getitem(v34, 2)  # i64[]
ep_send_2 = _local_scalar_dense(v39)  # u5
v40 = sym_constrain_range_for_size(ep_send_2)
v41 = getitem(v34, 3)  # i64[]
ep_send_3 = _local_scalar_dense(v41)  # u6
v42 = sym_constrain_range_for_size(ep_send_3)
v43 = getitem(v34, 4)  # i64[]
ep_send_4 = _local_scalar_dense(v43)  # u7
v44 = sym_constrain_range_for_size(ep_send_4)
v45 = getitem(v34, 5)  # i64[]
ep_send_5 = _local_scalar_dense(v45)  # u8
v46 = sym_constrain_range_for_size(ep_send_5)
v47 = getitem(v34, 6)  # i64[]
ep_send_6 = _local_scalar_dense(v47)  # u9
v48 = sym_constrain_range_for_size(ep_send_6)
v49 = getitem(v34, 7)  # i64[]
ep_send_7 = _local_scalar_dense(v49)  # u10
v50 = sym_constrain_range_for_size(ep_send_7)
v51 = getitem(v34, 8)  # i64[]
ep_recv_0 = _local_scalar_dense(v51)  # u11
v52 = sym_constrain_range_for_size(ep_recv_0)
v53 = getitem(v34, 9)  # i64[]
ep_recv_1 = _local_scalar_dense(v53)  # u12
v54 = sym_constrain_range_for_size(ep_recv_1)
v55 = getitem(v34, 10)  # i64[]
ep_recv_2 = _local_scalar_dense(v55)  # u13
v56 = sym_constrain_range_for_size(ep_recv_2)
v57 = getitem(v34, 11)  # i64[]
ep_recv_3 = _local_scalar_dense(v57)  # u14
v58 = sym_constrain_range_for_size(ep_recv_3)
v59 = getitem(v34, 12)  # i64[]
ep_recv_4 = _local_scalar_dense(v59)  # u15
v60 = sym_constrain_range_for_size(ep_recv_4)
v61 = getitem(v34, 13)  # i64[]
ep_recv_5 = _local_scalar_dense(v61)  # u16
v62 = sym_constrain_range_for_size(ep_recv_5)
v63 = getitem(v34, 14)  # i64[]
ep_recv_6 = _local_scalar_dense(v63)  # u17
v64 = sym_constrain_range_for_size(ep_recv_6)
v65 = getitem(v34, 15)  # i64[]
ep_recv_7 = _local_scalar_dense(v65)  # u18
v66 = sym_constrain_range_for_size(ep_recv_7)
v67 = ep_send_0 + ep_send_1  # u3+u4
v68 = v67 + ep_send_2  # u3+u4+u5
v69 = v68 + ep_send_3  # u3+u4+u5+u6
v70 = v69 + ep_send_4  # u3+u4+u5+u6+u7
v71 = v70 + ep_send_5  # u3+u4+u5+u6+u7+u8
v72 = v71 + ep_send_6  # u3+u4+u5+u6+u7+u8+u9
v73 = v72 + ep_send_7  # u10+u3+u4+u5+u6+u7+u8+u9
ep_assignment = narrow(v28, 0, 0, v73)  # i64[u10+u3+u4+u5+u6+u7+u8+u9]
ep_token = floor_divide(ep_assignment, 6)  # i64[u10+u3+u4+u5+u6+u7+u8+u9]
v74 = narrow(v27, 0, 0, v73)  # i64[u10+u3+u4+u5+u6+u7+u8+u9]
v75 = remainder(v74, 2)  # i64[u10+u3+u4+u5+u6+u7+u8+u9]
v76 = view(v22, [-1])  # f32[6*(((T+3)//4))]
v77 = index_select(v76, 0, ep_assignment)  # f32[u10+u3+u4+u5+u6+u7+u8+u9]
v78 = _to_copy(v75, dtype=f32)  # f32[u10+u3+u4+u5+u6+u7+u8+u9]
v79 = stack([v78, v77], 1)  # f32[u10+u3+u4+u5+u6+u7+u8+u9, 2]
v80 = index_select(in0, 0, ep_token)  # f32[u10+u3+u4+u5+u6+u7+u8+u9, 64]
v81 = _c10d_functional.all_to_all_single(v80, [ep_recv_0, ep_recv_1, ep_recv_2, ep_recv_3, ep_recv_4, ep_recv_5, ep_recv_6, ep_recv_7], [ep_send_0, ep_send_1, ep_send_2, ep_send_3, ep_send_4, ep_send_5, ep_send_6, ep_send_7], 'ep')  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 64]
ep_rows = _c10d_functional.wait_tensor(v81)  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 64]  <- EP dispatch: each assignment's token row to the rank of its expert
v82 = _c10d_functional.all_to_all_single(v79, [ep_recv_0, ep_recv_1, ep_recv_2, ep_recv_3, ep_recv_4, ep_recv_5, ep_recv_6, ep_recv_7], [ep_send_0, ep_send_1, ep_send_2, ep_send_3, ep_send_4, ep_send_5, ep_send_6, ep_send_7], 'ep')  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 2]
ep_routes = _c10d_functional.wait_tensor(v82)  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 2]  <- EP dispatch: each assignment's local expert in4 and routing weight
v83 = select(ep_routes, 1, 0)  # f32[u11+u12+u13+u14+u15+u16+u17+u18]
v84 = _to_copy(v83, dtype=i64)  # i64[u11+u12+u13+u14+u15+u16+u17+u18]
v85 = select(ep_routes, 1, 1)  # f32[u11+u12+u13+u14+u15+u16+u17+u18]
v86 = unsqueeze(v84, 1)  # i64[u11+u12+u13+u14+u15+u16+u17+u18, 1]
v87 = unsqueeze(v85, 1)  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 1]
ep_local_experts = dsv41.routed_experts(ep_rows, v86, v87, layers.0.ffn.experts.w1, layers.0.ffn.experts.w2, layers.0.ffn.experts.w3, 10.0)  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 64]
v88 = _c10d_functional.all_to_all_single(ep_local_experts, [ep_send_0, ep_send_1, ep_send_2, ep_send_3, ep_send_4, ep_send_5, ep_send_6, ep_send_7], [ep_recv_0, ep_recv_1, ep_recv_2, ep_recv_3, ep_recv_4, ep_recv_5, ep_recv_6, ep_recv_7], 'ep')  # f32[u10+u3+u4+u5+u6+u7+u8+u9, 64]
ep_combined = _c10d_functional.wait_tensor(v88)  # f32[u10+u3+u4+u5+u6+u7+u8+u9, 64]  <- EP combine: weighted expert outputs back to their source rank
v89 = zeros_like(in0, dtype=f32)  # f32[((T+3)//4), 64]
ep_routed_out = index_add(v89, 0, ep_token, ep_combined)  # S(0) f32[((T+3)//4), 64]
ep_stats = stack([ep_sent, ep_received])  # i64[2, 8]
v90 = t(layers.0.ffn.shared_expert.w1.weight)  # R f32[64, 32]
v91 = mm(in0, v90)  # S(0) f32[((T+3)//4), 32]
v92 = t(layers.0.ffn.shared_expert.w3.weight)  # R f32[64, 32]
v93 = mm(in0, v92)  # S(0) f32[((T+3)//4), 32]
v94 = clamp(v93, -10.0, 10.0)  # S(0) f32[((T+3)//4), 32]
v95 = clamp(v91, None, 10.0)  # S(0) f32[((T+3)//4), 32]
v96 = silu(v95)  # S(0) f32[((T+3)//4), 32]
v97 = mul(v96, v94)  # S(0) f32[((T+3)//4), 32]
v98 = t(layers.0.ffn.shared_expert.w2.weight)  # R f32[32, 64]
v99 = mm(v97, v98)  # S(0) f32[((T+3)//4), 64]
v100 = add(ep_routed_out, v99)  # S(0) f32[((T+3)//4), 64]""",
        )
