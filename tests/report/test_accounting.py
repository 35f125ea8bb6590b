"""Accounting read from the rewritten graph, against bytes and FLOPs computed by hand; the
replicated baseline's collectives against sp's.

tiny-swa (2 decoder layers, D = 64 fp32, 16 routed experts of width I = 32, top-6, shared
expert of width 32, N = 4 mHC streams; 3 Sinkhorn iterations, which no count depends on),
planned on meta tensors for rank 0 of a fake world of 8 (tp = 4, ep = 8), at T = 8 tokens per
DP group: Tl = 2 rows per rank. Costs are per layer.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from dsv41_compile.core.collectives import collective_kind
from dsv41_compile.core.meta import REGION
from dsv41_compile.deepseek_v41.testing.presets import ENGRAM_0, ONE_LAYER, WIDE, compile_config
from dsv41_compile.report.accounting import graph_costs, summarize

WORLD, TP, EP, T = 8, 4, 8, 8
LAYERS = 2
D, E, K, I, N = 64, 16, 6, 32, 4
TL = T // TP
F32 = 4
ROUTE = 8  # (local expert index, weight) per dispatched row


@pytest.fixture
def plan(plan_once):
    """(layout, EP dispatch) -> (gm, ctx), at comm_report's options and cache size."""

    def planned(
        layout: str,
        dispatch: str,
        rows: str = "per_assignment",
        exit: str = "reduce_scatter",
        entry: str = "input",
        cfg=None,
    ):
        options = {"tp": TP, "ep": EP, "ep_dispatch": dispatch, "layout": layout}
        options["ep_rows"], options["attn_exit"], options["attn_entry"] = rows, exit, entry
        options["lowering"] = "eager"
        cfg = cfg or compile_config()
        gm, ctx, _ = plan_once(cfg, options, world_size=WORLD, max_len=4096)
        return gm, ctx

    return planned


@pytest.fixture(params=["sp", "replicated"])
def planned(request, plan):
    return request.param, *plan(request.param, "padded")


def test_bytes_per_collective_by_hand(planned):
    layout, gm, ctx = planned
    summary = summarize(graph_costs(gm, ctx), T)
    ring = (TP - 1) * TL * D * F32  # (tp-1) shards of [Tl, D] fp32 each way
    # padded EP: every peer gets C = Tl * min(K, E/ep) rows of tokens, routes, outputs
    C = TL * min(K, E // EP)
    ep = (EP - 1) * C * (D * F32 + ROUTE + D * F32)
    if layout == "sp":
        expected = {"all_gather(tp)": ring, "reduce_scatter(tp)": ring}
    else:
        all_reduce = 2 * (TP - 1) * T * D * F32 // TP  # ring: reduce-scatter + all-gather
        expected = {"all_reduce(tp)": all_reduce, "all_gather(tp)": ring}
    expected["all_to_all(ep)"] = ep
    got = {kind: c["bytes_sent"] for kind, c in summary["collectives"].items()}
    assert got == expected
    assert summary["bytes_per_layer_per_rank"] == sum(expected.values())
    # parts are per call: both layers' MoE halves
    moe = ep + (ring if layout == "replicated" else 0)
    assert summary["parts"]["moe"]["bytes_sent"] == LAYERS * moe


def test_moe_flops_by_hand(planned):
    layout, gm, ctx = planned
    summary = summarize(graph_costs(gm, ctx), T)
    rows = TL if layout == "sp" else T  # per-token work: local rows or all T
    mhc_pre = 2 * rows * (N * D) * (2 * N + N * N)  # streams -> (pre, post, comb) coefficients
    gate = 2 * rows * D * E
    shared = 3 * 2 * rows * D * I
    routed = 3 * 2 * (EP * TL * min(K, E // EP)) * D * I  # every padded row handed to the kernel
    mhc_post = 2 * rows * N * N * D  # comb mixes the N streams
    assert summary["moe_flops_per_layer_per_rank"] == mhc_pre + gate + shared + routed + mhc_post


def test_exact_dispatch_counts_take_their_balanced_expectation(plan):
    gm, ctx = plan("sp", "exact")
    summary = summarize(graph_costs(gm, ctx), T)
    # K*Tl assignments leave the rank, 1/ep of them to itself: 7/8 of 12 rows each way
    moved = K * TL * (EP - 1) / EP
    counts = (EP - 1) * 8
    expected = counts + moved * (D * F32 + ROUTE) + moved * D * F32
    assert summary["collectives"]["all_to_all(ep)"]["bytes_sent"] == pytest.approx(expected)
    routed = 3 * 2 * K * TL * D * I  # K*Tl rows received in expectation, one route each
    mhc = 2 * TL * (N * D) * (2 * N + N * N) + 2 * TL * N * N * D
    assert summary["moe_flops_per_layer_per_rank"] == mhc + 2 * TL * D * E + 6 * TL * D * I + routed


# One row per (token, rank): a token reaches a given rank with probability
# p = 1 - C(E - E/ep, K) / C(E, K) = 1 - C(14, 6) / C(16, 6) = 5/8.
P_HIT = 1 - math.comb(E - E // EP, K) / math.comb(E, K)


def test_exact_dispatch_one_row_per_rank_by_hand(plan):
    gm, ctx = plan("sp", "exact", "per_rank")
    summary = summarize(graph_costs(gm, ctx), T)
    assert P_HIT == 5 / 8
    moved = P_HIT * TL * (EP - 1)  # rows to the other ranks, each way
    counts = (EP - 1) * 2 * 8  # rows and assignments per peer
    expected = counts + moved * (D * F32 + K * ROUTE) + moved * D * F32
    assert summary["collectives"]["all_to_all(ep)"]["bytes_sent"] == pytest.approx(expected)
    # the experts compute the valid routes only: K*Tl in expectation, as per assignment
    routed = 3 * 2 * K * TL * D * I
    mhc = 2 * TL * (N * D) * (2 * N + N * N) + 2 * TL * N * N * D
    flops = summary["moe_flops_per_layer_per_rank"]
    assert flops == pytest.approx(mhc + 2 * TL * D * E + 6 * TL * D * I + routed)


def test_attention_exit_all_to_all_by_hand(plan):
    """wo_a's output [T, G*o_lora = 64]: each rank sends 3 of its 4 token chunks of its 16
    columns, and runs wo_b (64 x 64) on its Tl rows instead of a quarter of it on T rows."""
    seed_gm, seed_ctx = plan("sp", "padded")
    gm, ctx = plan("sp", "padded", exit="all_to_all")
    seed, summary = (summarize(graph_costs(g, c), T) for g, c in ((seed_gm, seed_ctx), (gm, ctx)))
    a2a = (TP - 1) * TL * (64 // TP) * F32
    assert summary["collectives"]["all_to_all(tp)"] == {
        "count": 1, "bytes_sent": a2a, "bytes_received": a2a,
    }  # fmt: skip
    assert "reduce_scatter(tp)" not in summary["collectives"]
    assert seed["collectives"]["reduce_scatter(tp)"]["bytes_sent"] == (TP - 1) * TL * D * F32
    # wo_b: 2*T*(64/tp)*D on the seed's rank, 2*Tl*64*D here: the same FLOPs at T = tp*Tl
    assert (
        summary["attention_flops_per_layer_per_rank"] == seed["attention_flops_per_layer_per_rank"]
    )


def test_attention_entry_cut_by_hand(plan):
    """At twice tiny's width (D = 128) the q latent (after q_norm) and the kv latent (after
    kv_norm), 32 fp32 each, are narrower than the input: they are gathered side by side in one
    AllGather (3 chunks of Tl rows out, 3 in; `spmd.coalesce`) in place of the [Tl, 128] input,
    and wq_a / wkv (128 -> 32) run on Tl rows."""
    wide = compile_config("tiny-swa", ONE_LAYER, WIDE)
    seed_gm, seed_ctx = plan("sp", "padded", cfg=wide)
    gm, ctx = plan("sp", "padded", entry="auto", cfg=wide)
    seed, summary = (summarize(graph_costs(g, c), T) for g, c in ((seed_gm, seed_ctx), (gm, ctx)))
    latents = (TP - 1) * TL * 32 * F32
    assert summary["collectives"]["all_gather(tp)"] == {
        "count": 1, "bytes_sent": 2 * latents, "bytes_received": 2 * latents,
    }  # fmt: skip
    assert seed["collectives"]["all_gather(tp)"]["bytes_sent"] == (TP - 1) * TL * 128 * F32
    for kind in ("reduce_scatter(tp)", "all_to_all(ep)"):
        assert summary["collectives"][kind] == seed["collectives"][kind]
    saved = 2 * 2 * (T - TL) * 128 * 32  # wq_a and wkv on Tl rows, not T
    assert (
        summary["attention_flops_per_layer_per_rank"]
        == seed["attention_flops_per_layer_per_rank"] - saved
    )


def test_padded_dispatch_one_row_per_rank_by_hand(plan):
    gm, ctx = plan("sp", "padded", "per_rank")
    summary = summarize(graph_costs(gm, ctx), T)
    ep = (EP - 1) * TL * (D * F32 + K * ROUTE + D * F32)  # C = Tl rows per peer
    assert summary["collectives"]["all_to_all(ep)"]["bytes_sent"] == ep
    routed = 3 * 2 * (EP * TL * K) * D * I  # every row's K route slots handed to the kernel
    mhc = 2 * TL * (N * D) * (2 * N + N * N) + 2 * TL * N * N * D
    flops = summary["moe_flops_per_layer_per_rank"]
    assert flops == mhc + 2 * TL * D * E + 6 * TL * D * I + routed


def test_sp_has_no_all_reduce_and_replicated_one_per_layer(plan):
    cfg = compile_config()
    kinds = {}
    for layout in ("sp", "replicated"):
        gm, ctx = plan(layout, "exact")
        kinds[layout] = Counter(
            (n.meta[REGION], collective_kind(n)) for n in gm.graph.nodes if collective_kind(n)
        )
    for layer in range(cfg.n_layers):
        sp = {k: n for k, n in kinds["sp"].items() if k[0].startswith(f"layers.{layer}")}
        rep = {k: n for k, n in kinds["replicated"].items() if k[0].startswith(f"layers.{layer}")}
        assert sp == {
            (f"layers.{layer}.attn", "all_gather"): 1,
            (f"layers.{layer}", "reduce_scatter"): 1,
            (f"layers.{layer}.ffn", "all_to_all"): 3,  # counts, rows with routes, combine
        }
        # the MoE output is shared back to the TP group after each token's owner combined it
        assert rep == {
            (f"layers.{layer}", "all_reduce"): 1,
            (f"layers.{layer}.ffn", "all_gather"): 1,
            (f"layers.{layer}.ffn", "all_to_all"): 3,  # counts, rows with routes, combine
        }
    assert not any(kind == "all_reduce" for _, kind in kinds["sp"])


def test_replicated_baseline_routes_each_token_from_one_owner(plan):
    """The routed experts see the TP rank's token shard (its unique owners), padded with -1
    routes; the shared expert and gate see all T rows."""
    gm, ctx = plan("replicated", "exact")
    pads = [
        n
        for n in gm.graph.nodes
        if n.target is torch.ops.aten.constant_pad_nd.default
        and n.meta.get(REGION) == "layers.0.ffn"
    ]
    fills = sorted(n.args[2] for n in pads)
    # topk_idx (-1: routed nowhere); x, topk_weight, and the shared expert's output, added to
    # the routed output on the owned rows before the MoE output is gathered back
    assert fills == [-1, 0, 0, 0]


def test_a_split_tables_exchange_by_hand(plan_once):
    """Engram's tables split by column over the 8 ranks (6 columns: one per rank, ranks 6 and 7
    idle): per Engram layer a rank sends each peer Tl_max = ceil(T/tp) slots of one row id (8 B)
    and gets back as many rows of 32 e4m3 codes and one e8m0 scale (33 B); the replicated
    placement exchanges nothing."""
    cfg = compile_config("tiny-swa", ONE_LAYER, ENGRAM_0)
    options = {"tp": TP, "ep": EP, "ep_dispatch": "padded", "lowering": "eager"}
    tables = {}
    for engram, exit in (
        ("sharded", "auto"),
        ("sharded", "reduce_scatter"),
        ("replicated", "auto"),
    ):
        opts = {**options, "engram": engram, "attn_exit": exit}
        gm, ctx, _ = plan_once(cfg, opts, world_size=WORLD, max_len=64)
        tables[engram, exit] = summarize(graph_costs(gm, ctx), T)["tables"]
    tl_max = -(-T // TP)
    # the exchange alone, whatever else the layer moves (the exit's ReduceScatter or all-to-all)
    for exit in ("auto", "reduce_scatter"):
        split = tables["sharded", exit]
        assert split["layers"] == [0]
        assert split["bytes_sent_per_table_layer"] == (EP - 1) * tl_max * (8 + 33)
        assert split["bytes_received_per_table_layer"] == (EP - 1) * tl_max * (8 + 33)
        assert split["other_bytes_sent_per_table_layer"] > 0  # the layer's own
    tables["replicated"] = tables["replicated", "auto"]
    assert tables["replicated"]["layers"] == []
    assert tables["replicated"]["bytes_sent_per_table_layer"] == 0
