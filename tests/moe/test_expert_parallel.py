"""Expert parallelism on a fake 8-rank process group: the rewritten MoE block, the expert
shards, the statistics outputs, padding rows. (Numerics with real processes:
tests/distributed/test_numerics.py.)"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from fractions import Fraction

import expecttest
import pytest
import torch

from dsv41_compile.core.collectives import collective_kind
from dsv41_compile.core.meta import REASON, REGION
from dsv41_compile.core.placements import ExpertShard
from dsv41_compile.deepseek_v41.testing.batches import Request
from dsv41_compile.deepseek_v41.testing.fake_rank import compile_on_fake_rank, run_on_fake_rank
from dsv41_compile.deepseek_v41.testing.presets import ONE_LAYER, SLOW_LINK, compile_config
from dsv41_compile.moe.stats import EpLayer, ep_layers
from dsv41_compile.testing.fake_rank import collective_windows, layer_text, placement_counts

aten = torch.ops.aten
TINY_SWA = compile_config()  # 16 experts, top-6: 2 experts per rank at ep=8
ONE_LAYER_SWA = compile_config("tiny-swa", ONE_LAYER)


def ep_options(dispatch: str, **extra) -> dict:
    return {"tp": 4, "ep": 8, "ep_dispatch": dispatch, **extra}


@pytest.fixture(scope="module")
def exact_rank5():
    return compile_on_fake_rank(5, ep_options("exact"))


@pytest.fixture(scope="module")
def padded_rank2():
    """With the seed's attention exit: tests/test_verify.py's graph, compiled once."""
    return compile_on_fake_rank(2, ep_options("padded", attn_exit="reduce_scatter"))


def collectives_by_region(gm, ctx) -> Counter:
    counts = Counter()
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind:
            axis = "ep" if node.args[-1] == ctx.mesh.ep_group_name else "tp"
            counts[(node.meta[REGION], kind, axis)] += 1
    return counts


@pytest.mark.parametrize(("fixture", "a2a"), [("exact_rank5", 3), ("padded_rank2", 2)])
def test_moe_halves_talk_only_over_ep_and_attention_only_over_tp(fixture, a2a, request):
    gm, ctx, logits = request.getfixturevalue(fixture)
    assert logits.shape == (8, 512)
    expected = {("head", "all_gather", "tp"): 1}
    for i in range(2):
        # the exit: wo_b's input to its tokens' ranks (auto), or the seed's ReduceScatter
        exit = (
            (f"layers.{i}.attn.wo_b", "all_to_all") if ctx.options.family.attn_exit == "all_to_all"
            else (f"layers.{i}", "reduce_scatter")
        )  # fmt: skip
        expected[(f"layers.{i}.attn", "all_gather", "tp")] = 1
        expected[(*exit, "tp")] = 1
        # (counts,) the rows with their routes, combine
        expected[(f"layers.{i}.ffn", "all_to_all", "ep")] = a2a
    assert collectives_by_region(gm, ctx) == expected
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.dsv41.routed_experts.default
                and n.args[3].op == "placeholder" and "ep_local" not in n.name]  # fmt: skip


def test_comm_records_name_the_sizes_read_from_data(exact_rank5):
    """comm.json gives exact EP's data-dependent row counts the names graph.py gives them, the
    nodes that read them (`ep_send_k`: rows this rank sends EP rank k of the layer's eight;
    `ep_recv_k`: rows it receives), a sum of them as their range."""
    gm, ctx, _ = exact_rank5
    nodes = {n.name: n for n in gm.graph.nodes}
    for layer in range(2):
        send, recv = (
            f"sum({side}_{8 * layer}..{8 * layer + 7})" for side in ("ep_send", "ep_recv")
        )
        records = [
            r for r in ctx.comm if r["layer"] == layer and r["bytes_sent"] == "data-dependent"
        ]
        assert [(r["input_shape"], r["output_shape"]) for r in records] == [
            ([send, "76"], [recv, "76"]),  # dispatch: the token rows, their 12 route values
            ([recv, "64"], [send, "64"]),  # combine: the rows back
        ]
        dispatch = nodes[records[0]["node"]]  # all_to_all_single(x, output splits, input splits)
        assert [a.name for a in dispatch.args[2]] == [f"ep_send_{8 * layer + k}" for k in range(8)]
        assert [a.name for a in dispatch.args[1]] == [f"ep_recv_{8 * layer + k}" for k in range(8)]


@pytest.mark.parametrize("fixture", ["exact_rank5", "padded_rank2"])
def test_each_rank_holds_its_own_slice_of_the_experts(fixture, request):
    gm, ctx, _ = request.getfixturevalue(fixture)
    rank = ctx.mesh.rank
    experts = {
        s.fqn: s
        for s in ctx.signature.param_shards.values()
        if isinstance(s.placement, ExpertShard)
    }
    assert sorted(experts) == [
        f"layers.{i}.ffn.experts.{w}" for i in range(2) for w in ("w1", "w2", "w3")
    ]
    assert {(s.dim, s.parts, s.axis) for s in experts.values()} == {(0, 8, "ep")}
    assert ctx.mesh.axis_rank("ep") == rank  # the shard the program slices (test_program)
    local = [n for n in gm.graph.nodes if n.name.startswith("ep_local_experts")]
    assert [n.args[3].meta["val"].shape for n in local] == [torch.Size([2, 32, 64])] * 2
    assert [layer.layer for layer in ep_layers(ctx)] == [0, 1]


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
    gm, ctx, _ = exact_rank5
    outputs = gm.graph.output_node().args[0]
    assert [n.name for n in outputs[-2:]] == ["ep_stats", "ep_stats_1"]
    # assignments sent / received, rows sent / received (one row per token and rank)
    assert [layer.rows for layer in ep_layers(ctx)] == ["per_rank"] * 2
    assert [tuple(n.meta["val"].shape) for n in outputs[-2:]] == [(4, 8)] * 2


@pytest.mark.parametrize(("dispatch", "rows", "per_token"), [
    ("padded", "per_rank", 1), ("padded", "per_assignment", 2),
])  # fmt: skip
def test_padded_buffer_rows_per_peer(dispatch, rows, per_token):
    """Every peer's block holds C = Tl_max rows (one per token and rank) or
    Tl_max * min(K, E/ep) = 2 Tl_max (one per assignment; 2 experts per rank)."""
    gm, ctx, _ = compile_on_fake_rank(2, ep_options(dispatch, ep_rows=rows), cfg=ONE_LAYER_SWA)
    (tl_max,) = [n.meta["val"] for n in gm.graph.nodes if n.name == "ep_tokens"]
    a2a = [n for n in gm.graph.nodes if collective_kind(n) == "all_to_all"
           and n.args[-1] == ctx.mesh.ep_group_name]  # fmt: skip
    assert len(a2a) == 2  # the rows with their routes (fp32 side by side), combine
    for node in a2a:
        assert [s.meta["val"] for s in node.args[1]] == [per_token * tl_max] * 8
    widths = [n.meta["val"].shape[1] for n in a2a]
    # the rows' 64 columns, then their routes': per route an expert index and a weight
    assert widths == [64 + 2 * (6 if rows == "per_rank" else 1), 64]


def test_auto_picks_the_form_with_fewer_expected_bytes_and_says_why(exact_rank5):
    gm, ctx, _ = exact_rank5
    (layer, _) = ep_layers(ctx)
    # 16 experts, top-6, 2 per rank: a token reaches 1 - C(14, 6)/C(16, 6) = 5/8 of the ranks
    assert layer.expected_rows_per_peer == 1 - Fraction(3003, 8008)
    per_assignment = dataclasses.replace(layer, rows="per_assignment")
    assert per_assignment.expected_rows_per_peer == Fraction(6, 8)
    # 7 peers * rows * (2 * 256 B fp32 rows + route bytes)
    assert layer.bytes_per_token() == pytest.approx(7 * 5 / 8 * (512 + 48))
    assert per_assignment.bytes_per_token() == pytest.approx(7 * 6 / 8 * (512 + 8))
    (dispatch,) = [n for n in gm.graph.nodes if n.name == "ep_rows"]
    assert dispatch.meta[REASON].endswith(
        "(ep_rows='auto': per_rank, 2,450 B per token (expected, dispatch + combine) "
        "against 2,730 B per_assignment)"
    )


def test_expected_rows_per_token_at_flash_sizes():
    """384 experts, top-6, ep=8: 4.43 destination ranks per token against 6;
    with one expert per rank the forms send the same rows, and the per-assignment form's
    smaller routes win."""
    flash = EpLayer(
        layer=0, region="", dispatch="exact", ep=8, experts_per_rank=48, top_k=6,
        token_row_bytes=2 * 5120, rows="per_rank",
    )  # fmt: skip
    assert float(flash.expected_rows_per_peer * 8) == pytest.approx(4.4298, abs=1e-4)
    one_each = dataclasses.replace(flash, experts_per_rank=1, token_row_bytes=16)
    assert one_each.expected_rows_per_peer == Fraction(6, 8)
    other = dataclasses.replace(one_each, rows="per_assignment")
    assert other.bytes_per_token() < one_each.bytes_per_token()


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


def test_step_record_bytes_by_hand_one_row_per_rank():
    layer = EpLayer(
        layer=0, region="layers.0.ffn", dispatch="exact", ep=4, experts_per_rank=2, top_k=3,
        token_row_bytes=64 * 2, rows="per_rank",
    )  # fmt: skip
    # assignments sent, received; rows sent, received (a row carries 1 or 2 assignments)
    stats = torch.tensor([[2, 5, 0, 1], [3, 4, 1, 0], [1, 3, 0, 1], [2, 3, 1, 0]])
    record = layer.step_record(stats, ep_tokens=3, rank=1)
    assert record["assignments_sent"] == 8 and record["rows_sent_per_rank"] == [1, 3, 0, 1]
    # to peers 0, 2, 3: 2 rows of 128 B + 3 routes of 8 B; two counts per peer
    assert record["dispatch_bytes_sent"] == 2 * (128 + 24) + 3 * 16
    assert record["combine_bytes_sent"] == (2 + 1 + 0) * 128  # rows received from peers
    padded = EpLayer(**{**layer.__dict__, "dispatch": "padded"}).step_record(stats, 3, rank=1)
    assert padded["dispatch_bytes_sent"] == 3 * 3 * (128 + 24)  # C = 3 tokens per peer
    assert padded["combine_bytes_sent"] == 3 * 3 * 128
    assert padded["valid_dispatch_bytes_sent"] == 2 * 152


class TestMoeSnapshot(expecttest.TestCase):
    def test_moe_block_of_layer_0_exact_dispatch(self):
        """One row per assignment. Gate on the local token shard, dispatch (count exchange,
        host read of the splits, rows and routes), this rank's two experts, combine, fp32 sum
        at the source, shared expert on the local rows. No TP collective, no all-reduce. The
        snapshot: each collective with the lines around it; the counts pin the block's other
        ops by placement."""
        gm, ctx, _ = compile_on_fake_rank(5, ep_options("exact", ep_rows="per_assignment"))
        text = layer_text(gm, ctx, "layers.0.ffn")
        self.assertExpectedInline(
            collective_windows(text),
            """\
v31 = eq(v29, v30)  # b8[6*(((T+3)//4)), 8]
ep_sent = sum(v31, [0])  # i64[8]
v32 = _c10d_functional.all_to_all_single(ep_sent, [1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1], 'ep')  # i64[8]
ep_received = _c10d_functional.wait_tensor(v32)  # i64[8]  <- EP count exchange: how many assignments each rank sends this rank
v33 = cat([ep_sent, ep_received])  # i64[16]
v34 = unbind(v33)  # (i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[], i64[])
...
v80 = index_select(in0, 0, ep_token)  # f32[u10+u3+u4+u5+u6+u7+u8+u9, 64]
v81 = cat([v80, v79], 1)  # f32[u10+u3+u4+u5+u6+u7+u8+u9, 66]
v82 = _c10d_functional.all_to_all_single(v81, [ep_recv_0, ep_recv_1, ep_recv_2, ep_recv_3, ep_recv_4, ep_recv_5, ep_recv_6, ep_recv_7], [ep_send_0, ep_send_1, ep_send_2, ep_send_3, ep_send_4, ep_send_5, ep_send_6, ep_send_7], 'ep')  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 66]
ep_rows = _c10d_functional.wait_tensor(v82)  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 66]  <- EP dispatch: each assignment's token row to the rank of its expert; with its local expert index and routing weight (ep_rows='per_assignment': per_assignment, 2,730 B per token (expected, dispatch + combine) against 2,450 B per_rank)
v83 = split_with_sizes(ep_rows, [64, 2], 1)  # (f32[u11+u12+u13+u14+u15+u16+u17+u18, 64], f32[u11+u12+u13+u14+u15+u16+u17+u18, 2])
v84 = getitem(v83, 0)  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 64]
...
v90 = clone(v89, memory_format=torch.contiguous_format)  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 1]
ep_local_experts = dsv41.routed_experts(v85, v88, v90, layers.0.ffn.experts.w1, layers.0.ffn.experts.w2, layers.0.ffn.experts.w3, 10.0)  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 64]
v91 = _c10d_functional.all_to_all_single(ep_local_experts, [ep_send_0, ep_send_1, ep_send_2, ep_send_3, ep_send_4, ep_send_5, ep_send_6, ep_send_7], [ep_recv_0, ep_recv_1, ep_recv_2, ep_recv_3, ep_recv_4, ep_recv_5, ep_recv_6, ep_recv_7], 'ep')  # f32[u10+u3+u4+u5+u6+u7+u8+u9, 64]
ep_combined = _c10d_functional.wait_tensor(v91)  # f32[u10+u3+u4+u5+u6+u7+u8+u9, 64]  <- EP combine: weighted expert outputs back to their source rank
v92 = zeros_like(in0, dtype=f32)  # f32[((T+3)//4), 64]
ep_routed_out = index_add(v92, 0, ep_token, ep_combined)  # S(0) f32[((T+3)//4), 64]""",
        )
        self.assertExpectedInline(
            str(placement_counts(gm, "layers.0.ffn")),
            """{'(S(0), S(0))': 1, '-': 98, 'R': 6, 'S(0)': 26}""",
        )

    def test_dispatch_of_layer_0_one_row_per_token_and_rank(self):
        """One row per (token, destination rank): which ranks each route hits, rows and
        assignments counted per destination and exchanged, the (rank, token) pairs that hit
        sent in rank order with the token's K routes (-1 where another rank holds the
        expert), this rank's experts summing a row's routes, the sums combined back and added
        in fp32 in rank order (= expert order). From the gate's output to the statistics.
        The default options' program (`ep_rows="auto"` picks this form at tiny's sizes). The
        snapshot: each collective with the lines around it; the counts pin the rest."""
        gm, ctx, _ = compile_on_fake_rank(5, ep_options("exact"))
        assert [info.rows for info in ep_layers(ctx)] == ["per_rank"] * 2
        text = layer_text(gm, ctx, "layers.0.ffn")
        self.assertExpectedInline(
            collective_windows(text),
            """\
v32 = sum(ep_hit, [1, 2])  # i64[8]
v33 = stack([ep_sent, v32], 1)  # i64[8, 2]
v34 = _c10d_functional.all_to_all_single(v33, [1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1], 'ep')  # i64[8, 2]
ep_received = _c10d_functional.wait_tensor(v34)  # i64[8, 2]  <- EP count exchange: how many rows (and assignments) each rank sends this rank
v35 = select(ep_received, 1, 0)  # i64[8]
v36 = cat([ep_sent, v35])  # i64[16]
...
v92 = index_select(in0, 0, ep_token)  # f32[u10+u3+u4+u5+u6+u7+u8+u9, 64]
v93 = cat([v92, v91], 1)  # f32[u10+u3+u4+u5+u6+u7+u8+u9, 76]
v94 = _c10d_functional.all_to_all_single(v93, [ep_recv_0, ep_recv_1, ep_recv_2, ep_recv_3, ep_recv_4, ep_recv_5, ep_recv_6, ep_recv_7], [ep_send_0, ep_send_1, ep_send_2, ep_send_3, ep_send_4, ep_send_5, ep_send_6, ep_send_7], 'ep')  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 76]
ep_rows = _c10d_functional.wait_tensor(v94)  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 76]  <- EP dispatch: each token's row once to each rank holding one of its experts; with the token's K routes on that rank (local expert index or -1, weight) (ep_rows='auto': per_rank, 2,450 B per token (expected, dispatch + combine) against 2,730 B per_assignment)
v95 = split_with_sizes(ep_rows, [64, 12], 1)  # (f32[u11+u12+u13+u14+u15+u16+u17+u18, 64], f32[u11+u12+u13+u14+u15+u16+u17+u18, 12])
v96 = getitem(v95, 0)  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 64]
...
v102 = clone(v101, memory_format=torch.contiguous_format)  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 6]
ep_local_experts = dsv41.routed_experts(v97, v100, v102, layers.0.ffn.experts.w1, layers.0.ffn.experts.w2, layers.0.ffn.experts.w3, 10.0)  # f32[u11+u12+u13+u14+u15+u16+u17+u18, 64]
v103 = _c10d_functional.all_to_all_single(ep_local_experts, [ep_send_0, ep_send_1, ep_send_2, ep_send_3, ep_send_4, ep_send_5, ep_send_6, ep_send_7], [ep_recv_0, ep_recv_1, ep_recv_2, ep_recv_3, ep_recv_4, ep_recv_5, ep_recv_6, ep_recv_7], 'ep')  # f32[u10+u3+u4+u5+u6+u7+u8+u9, 64]
ep_combined = _c10d_functional.wait_tensor(v103)  # f32[u10+u3+u4+u5+u6+u7+u8+u9, 64]  <- EP combine: each row's weighted sum over the rank's experts back to its source rank
v104 = zeros_like(in0, dtype=f32)  # f32[((T+3)//4), 64]
ep_routed_out = index_add(v104, 0, ep_token, ep_combined)  # S(0) f32[((T+3)//4), 64]""",
        )
        self.assertExpectedInline(
            str(placement_counts(gm, "layers.0.ffn")),
            """{'(S(0), S(0))': 1, '-': 112, 'R': 6, 'S(0)': 26}""",
        )


def test_ep_dispatch_auto_flips_with_the_link_and_the_rows():
    """The same model (tiny-swa, one layer): `ep_dispatch="auto"` takes the padded dispatch on
    the 950DT at the default 8 rows per step (two collectives' latency and a few padded rows
    against exact's three and the host's read of the counts) and the exact one on a 100 MB/s
    link at 4096 rows (the padded rows' bytes dominate); the choice and both times are the EP
    layer's `why` (comm.json, graph.py, tools/explain.py). The two lowerings are exact on 8
    gloo ranks: tests/distributed/test_front_door.py (auto -> padded) and test_numerics.py
    (auto -> exact)."""
    chosen = {}
    for name, extra in (("950dt", {}), ("slow-link", {"device": SLOW_LINK, "rows_per_step": 4096})):
        gm, ctx, _ = compile_on_fake_rank(2, {"tp": 4, "ep": 8, **extra}, cfg=ONE_LAYER_SWA)
        (layer,) = ep_layers(ctx)
        chosen[name] = layer.dispatch
        assert layer.why.startswith(f"ep_dispatch='auto': {layer.dispatch}, "), layer.why
        assert f" on {name} at " in layer.why
        a2a = [n for n in gm.graph.nodes if collective_kind(n) == "all_to_all"
               and n.args[-1] == ctx.mesh.ep_group_name]  # fmt: skip
        assert len(a2a) == {"padded": 2, "exact": 3}[layer.dispatch]
    assert chosen == {"950dt": "padded", "slow-link": "exact"}


def test_ep_dispatch_auto_weighs_the_link_between_nodes_when_the_world_spans_nodes():
    """The same choice at 4096 rows per step on one device, with nodes of 8 ranks (the EP
    group of 8 within one: the fast link) and of 4 (it spans two nodes, whose link is 10000x
    slower): the slow link's share of the all-to-all's bytes turns the choice to the dispatch
    that sends fewer (`Device.collective_seconds`)."""
    fast = dataclasses.replace(SLOW_LINK, name="nodes", link_bytes_per_s=1e12)
    chosen = {}
    for per_node in (8, 4):
        device = dataclasses.replace(fast, ranks_per_node=per_node)
        options = {"tp": 4, "ep": 8, "device": device, "rows_per_step": 4096}
        _, ctx, _ = compile_on_fake_rank(2, options, cfg=ONE_LAYER_SWA)
        (layer,) = ep_layers(ctx)
        chosen[per_node] = layer.dispatch
    assert chosen == {8: "padded", 4: "exact"}
