"""Tier 2: the rewritten per-rank graph on a fake process group (no communication happens)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import expecttest
import pytest
import torch
import torch._dynamo
from torch.distributed.tensor import Shard

import dsv41_compile
from dsv41_compile.core.collectives import collective_kind
from dsv41_compile.core.meta import COALESCED, GLOBAL_VAL, OUT, REASON, REGION, module_paths
from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig
from dsv41_compile.deepseek_v41.testing.batches import Request, pack
from dsv41_compile.deepseek_v41.testing.fake_rank import compile_on_fake_rank
from dsv41_compile.deepseek_v41.testing.presets import ONE_LAYER, SLOW_HBM, WIDE, compile_config
from dsv41_compile.report.dump import graph_labels
from dsv41_compile.report.graph_printer import format_graph
from dsv41_compile.spmd.entry_cut import entry_cuts
from dsv41_compile.testing.fake_rank import (
    collective_windows,
    compile_model_on_fake_rank,
    layer_text,
    placement_counts,
)
from dsv41_compile.testing.observe import capture_programs
from dsv41_compile.testing.torch_shims import fake_process_group
from dsv41_compile.testing.toy import ToyLM, toy_family


@pytest.fixture(scope="module")
def rank1():
    return compile_on_fake_rank(1, {"tp": 4})


@pytest.fixture(scope="module")
def seed_rank1():
    """The seed's layout exactly: the input gathered, the wo_b partial reduce-scattered."""
    return compile_on_fake_rank(1, {"tp": 4, "attn_entry": "input", "attn_exit": "reduce_scatter"})


@pytest.fixture(scope="module")
def rank6_dumped(tmp_path_factory):
    """Rank 6 (the other DP group, another tp_rank) compiled with a dump: its dump folder."""
    dump = tmp_path_factory.mktemp("dump")
    return (*compile_on_fake_rank(6, {"tp": 4, "dump_dir": str(dump)}), dump)


def collectives(gm) -> list:
    return [n for n in gm.graph.nodes if collective_kind(n)]


def test_one_all_gather_of_the_2d_attention_input_and_one_fp32_reduce_scatter_per_layer(
    seed_rank1,
):
    gm, ctx, logits = seed_rank1
    assert logits.shape == (8, 512)
    per_layer = Counter()
    for node in collectives(gm):
        region = node.meta[REGION]
        per_layer[
            (
                region.split(".")[1] if region.startswith("layers.") else region,
                collective_kind(node),
            )
        ] += 1
        source = node.args[0].meta["val"]
        if collective_kind(node) == "all_gather" and region.startswith("layers."):
            assert region.endswith(".attn") and source.dim() == 2 and source.shape[1] == 64
        if collective_kind(node) == "reduce_scatter":
            assert source.dtype == torch.float32
        assert ".ffn" not in region, "the MoE half has no TP collective"
    assert per_layer == {
        ("0", "all_gather"): 1,
        ("0", "reduce_scatter"): 1,
        ("1", "all_gather"): 1,
        ("1", "reduce_scatter"): 1,
        ("head", "all_gather"): 1,  # the exit gather of the normed [Tl, D] hidden
    }
    assert not any(collective_kind(n) == "all_reduce" for n in gm.graph.nodes)


@pytest.fixture(scope="module")
def slow_hbm_rank1():
    """One window-only layer, tp=4, on a device whose memory is slow (`SLOW_HBM`)."""
    cfg = compile_config("tiny-swa", ONE_LAYER)
    return compile_on_fake_rank(1, {"tp": 4, "device": SLOW_HBM}, cfg=cfg)


def test_the_head_is_sharded_where_the_device_model_says_it_pays(rank1, slow_hbm_rank1):
    """tiny-swa's head at tp=4: on the 950DT, reading it whole (0.03 us) beats a gather of the
    logits (10 us of latency); on a device with slow memory, each rank's quarter of it wins.
    Each rank then computes its V/tp logits and one AllGather assembles them: 32,768 B at
    1e8 B/s (327.7 us), 10 us of latency, 3/4 of 8 x 512 x 4 B at 50 GB/s (0.2 us)."""
    _, ctx, _ = rank1
    assert ctx.options.family.head == "replicated"
    assert ctx.choices["head"].startswith("head='auto': replicated, 0.0 us per step against ")
    gm, ctx, logits = slow_hbm_rank1
    assert ctx.options.family.head == "vocab_sharded"
    assert ctx.choices["head"] == (
        "head='auto': vocab_sharded, 337.9 us per step against 1310.7 us replicated on slow-hbm "
        "at 8 rows per step (the head 131,072 B; sharded: 32,768 B per rank and an AllGather "
        "of 4,096 B per rank)"
    )
    assert logits.shape == (8, 512)
    # the head is one of the rank's shards, and the logits leave in one gather of [T, V/tp]
    assert [s.fqn for s in ctx.signature.param_shards.values()].count("head.weight") == 1
    last = list(collectives(gm))[-1]
    assert collective_kind(last) == "all_gather"
    assert last.args[0].meta["val"].shape[1] == 128  # [T, V/tp]


def test_the_shared_expert_is_split_over_tp_where_the_device_model_says_it_pays(
    rank1, slow_hbm_rank1
):
    """tiny-swa's shared expert (three [32, 64] fp32 weights, 24,576 B) at tp=4 and 8 rows:
    on the 950DT each rank reads it whole (0.01 us), less than the split's two collectives
    (10 us of latency each); at 1e8 B/s the whole read takes 245.8 us, a quarter of it and the
    two collectives 81.5 us. Split, `w1` / `w3` hold a quarter of the hidden columns and `w2`
    a quarter of its rows on each rank; the expert's [Tl, D] input is gathered where it enters
    and its output's partial sum reduce-scattered back to the token shards in the MoE half."""
    _, ctx, _ = rank1
    why = ctx.choices["layers.*.ffn.shared_expert"]
    assert ctx.options.family.shared_expert == "whole"
    assert why.startswith("shared_expert='auto': whole, 0.0 us per layer against 20.0 us split")
    gm, ctx, logits = slow_hbm_rank1
    assert ctx.options.family.shared_expert == "split"
    assert ctx.choices["layers.*.ffn.shared_expert"] == (
        "shared_expert='auto': split, 81.5 us per layer against 245.8 us whole on slow-hbm at "
        "8 rows per step (24,576 B of weights per layer whole, 6,144 B per rank split; split "
        "gathers its input and reduce-scatters its output, 1,536 B each per rank)"
    )
    shards = {s.fqn: s for s in ctx.signature.param_shards.values()}
    for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):  # [I, D], [I, D], [D, I]
        shard = shards[f"layers.0.ffn.shared_expert.{name}.weight"]
        assert (shard.dim, shard.parts, shard.axis) == (dim, 4, "tp")
    moe = Counter(
        (n.meta[REGION], collective_kind(n))
        for n in collectives(gm)
        if n.meta[REGION].startswith("layers.0.ffn")
    )
    assert moe == {
        ("layers.0.ffn.shared_expert", "all_gather"): 1,  # its [Tl, D] input
        ("layers.0.ffn", "reduce_scatter"): 1,  # its output's partial, added to the routed
    }
    assert logits.shape == (8, 512)


@pytest.fixture(scope="module")
def prefill_rank1():
    """The default options at a prefill-sized workload (4096 rows per step)."""
    return compile_on_fake_rank(1, {"tp": 4, "rows_per_step": 4096})


def test_auto_exits_attention_by_the_time_of_a_step(rank1):
    """At the default workload (8 rows per step, 950DT) the all-to-all's 144 B per token saved
    on the wire do not pay for reading the 12,288 B of wo_b beyond the rank's shard: the
    ReduceScatter of wo_b's fp32 partial, wo_b row-parallel, as in the seed's layout."""
    gm, ctx, _ = rank1
    assert ctx.options.family.attn_exit == "reduce_scatter"
    (why,) = [w for w in ctx.choices.values() if w.startswith("attn_exit")]
    assert why == (
        "attn_exit='auto': reduce_scatter, 10.002 us per layer against 10.003 us all_to_all on "
        "950dt at 8 rows per step (10 us per collective; 192 B per token against 48 B; "
        "all_to_all would read +12,288 B of wo_b per layer)"
    )
    kinds = Counter(collective_kind(n) for n in collectives(gm))
    assert kinds == {"all_gather": 3, "reduce_scatter": 2}  # per layer: entry, exit; the head


def test_auto_exits_attention_with_an_all_to_all_of_wo_bs_input_at_prefill_sizes(prefill_rank1):
    """tiny-swa, tp=4, 4096 rows per step: of wo_a's output [T, 64] (fp32 here) each rank holds
    16 columns; the all-to-all moves 3/4 x 16 x 4 = 48 B per token against the ReduceScatter's
    3/4 x 64 x 4 = 192 B, which at 4096 rows outweighs reading wo_b (64 x 64 fp32) whole: 3/4
    of it, 12,288 B, more per layer and rank."""
    gm, ctx, logits = prefill_rank1
    assert logits.shape == (8, 512)
    kinds = Counter((n.meta[REGION], collective_kind(n)) for n in collectives(gm))
    assert kinds == {
        ("layers.0.attn", "all_gather"): 1,
        ("layers.0.attn.wo_b", "all_to_all"): 1,
        ("layers.1.attn", "all_gather"): 1,
        ("layers.1.attn.wo_b", "all_to_all"): 1,
        ("head", "all_gather"): 1,
    }
    for node in collectives(gm):
        if collective_kind(node) == "all_to_all":
            assert tuple(node.args[0].meta["val"].shape[1:]) == (16,)  # [Tpad, W/tp] in
            assert node.meta[REASON].endswith(
                "; attn_exit='auto': all_to_all, 10.200 us per layer against 10.786 us "
                "reduce_scatter on 950dt at 4096 rows per step (10 us per collective; 48 B per "
                "token against 192 B; wo_b replicated: +24,576 B of weights per rank)"
            )
    assert ctx.options.family.attn_exit == "all_to_all"
    wo_b = [s for s in ctx.signature.param_shards.values() if s.fqn.endswith("wo_b.weight")]
    assert wo_b == []  # whole on every rank
    assert not any(collective_kind(n) in ("reduce_scatter", "all_reduce") for n in gm.graph.nodes)


@pytest.fixture(scope="module")
def wide_rank1():
    """One window-only layer at twice tiny's width (D = 128), the default options."""
    return compile_on_fake_rank(1, {"tp": 4}, cfg=compile_config("tiny-swa", ONE_LAYER, WIDE))


def test_auto_entry_gathers_the_q_and_kv_latents_where_they_are_narrower(wide_rank1):
    """D = 128: wq_a -> q_norm and wkv -> kv_norm run on the token shard and their [Tl, 32]
    fp32 outputs are gathered, 2 x 128 B per token row against the input's 512 B, side by side
    in one AllGather (`spmd.coalesce`); the input itself is not gathered. The ops after them
    (head-sharded wq_b, rope, the window, the cache write) see all T rows, as before."""
    gm, ctx, logits = wide_rank1
    assert logits.shape == (8, 512)
    gathers = [n for n in collectives(gm) if n.meta[REGION] == "layers.0.attn"]
    assert [collective_kind(n) for n in gathers] == ["all_gather"]
    (rows,) = [n.args[0] for n in gathers]
    assert rows.target is torch.ops.aten.cat.default and rows.args[1] == 1
    sources = rows.args[0]
    assert [module_paths(s)[-1] for s in sources] == [
        "layers.0.attn.q_norm", "layers.0.attn.kv_norm",
    ]  # fmt: skip
    assert [(dtype, columns) for _, dtype, columns in gathers[0].meta[COALESCED]] == [
        ("float32", 32), ("float32", 32),
    ]  # fmt: skip
    for source in sources:
        assert (source.meta[OUT], source.meta["val"].dtype) == (Shard(0), torch.float32)
        assert source.meta[GLOBAL_VAL].shape[1:] == (32,)
    cut = entry_cuts(ctx)["layers.0.attn"]
    assert cut.gathered == tuple(sources) and cut.row_bytes == (128, 128)
    assert cut.input_row_bytes == 128 * 4
    why = (
        "attn_entry='auto': 14 per-token ops on the token shard, gathered q_norm 128 + kv_norm "
        "128 = 256 B per token row against 512 B for the input"
    )
    for node in gathers:
        assert f"; {why}" in node.meta[REASON], node.meta[REASON]
    moved = Counter(module_paths(n)[-1].removeprefix("layers.0.attn.") for n in cut.sharded)
    assert moved == {"wq_a": 1, "q_norm": 6, "wkv": 1, "kv_norm": 6}  # two mm, two RMSNorms
    # the projections of the latents read the token shard: [Tl, 128] @ [128, 32]
    mms = [n for n in cut.sharded if n.target is torch.ops.aten.mm.default]
    assert len(mms) == 2
    for mm in mms:
        assert mm.meta[OUT] == Shard(0) and mm.args[0].meta["val"].shape[1] == 128
    assert not any(collective_kind(n) == "all_gather" and n.args[0].meta["val"].shape[-1] == 128
                   and n.meta[REGION] == "layers.0.attn" for n in gm.graph.nodes)  # fmt: skip


def test_auto_entry_keeps_the_input_where_nothing_is_narrower(rank1, seed_rank1):
    """tiny (D = 64): the latents' 32 + 32 equal the input's 64, a tie, which goes to the fewer
    collectives: the input, the seed's layout. attn_entry="input" plans no cut."""
    _, ctx, _ = rank1
    for layer in (0, 1):
        cut = entry_cuts(ctx)[f"layers.{layer}.attn"]
        assert not cut.sharded and cut.input_row_bytes == 256
        assert ctx.choices[f"layers.{layer}.attn"] == (
            "attn_entry='auto': the input, 256 B per token row, against 256 B for the cheapest cut"
        )
    _, seed_ctx, _ = seed_rank1
    assert seed_ctx.plan.entry_cuts == () and entry_cuts(seed_ctx) == {}


def test_graph_text_is_identical_on_every_rank(rank1, rank6_dumped):
    """Rank 1 against rank 6: another tp_rank (2, not 1) of the other DP group, compiled with a
    dump, which changes nothing in the graph. What lets one rank of a host compile for all
    (`runtime.host_cache`)."""
    texts = []
    for gm, ctx, _ in (rank1, rank6_dumped[:3]):
        labels, groups = graph_labels(ctx)
        texts.append(format_graph(gm, labels=labels, groups=groups))
    assert rank6_dumped[1].mesh.rank == 6 and texts[0] == texts[1]


def test_vocab_sharded_embedding_enters_with_one_reduce_scatter():
    cfg = compile_config("tiny-swa", ONE_LAYER)  # the embedding and the first layer's entry
    gm, _, _ = compile_on_fake_rank(2, {"tp": 4, "embedding": "vocab_sharded"}, cfg=cfg)
    first, *rest = collectives(gm)
    assert collective_kind(first) == "reduce_scatter"
    partials = first.args[0].meta["val"]
    assert partials.dim() == 2 and partials.shape[1] == 64  # [T, D], not the [T, 4, D] streams
    assert partials.dtype == torch.float32
    # the entry's gather, the exit's ReduceScatter (attn_exit="auto" at 8 rows), the head's
    assert [collective_kind(n) for n in rest] == ["all_gather", "reduce_scatter", "all_gather"]


def test_dump_writes_graph_and_comm_records(rank6_dumped):
    *_, dump = rank6_dumped
    graph = (dump / "rank6" / "graph.py").read_text()
    assert "_c10d_functional.all_gather_into_tensor(" in graph and "<- S(0) -> R" in graph
    comm = json.loads((dump / "rank6" / "comm.json").read_text())
    assert (comm["rank"], comm["tp_rank"], comm["dp_rank"]) == (6, 2, 1)
    kinds = [c["kind"] for c in comm["collectives"]]
    assert kinds == ["all_gather", "reduce_scatter"] * 2 + ["all_gather"]
    assert comm["collectives_per_layer"] == {"0": 2, "1": 2}  # the head's gather is no layer's
    first = comm["collectives"][0]
    assert first["layer"] == 0 and first["axis"] == "tp" and first["group_size"] == 4
    assert first["input_shape"] == ["((T + 3)//4)", "64"]
    # ring all-gather: 3 of the 4 shards of Tl x 64 fp32 go out and come in
    assert first["bytes_sent"] == first["bytes_received"] == "768*(((T + 3)//4))"
    assert first["bytes_sent_at"] == {
        "T=1": 3 * 64 * 4,
        "T=8": 3 * 2 * 64 * 4,
        "T=2048": 3 * 512 * 64 * 4,
    }


@pytest.mark.parametrize("attn_exit", ["reduce_scatter", "all_to_all"])
def test_bf16_rounding_boundaries_are_the_single_device_ones(attn_exit):
    cfg = compile_config("tiny-swa", ONE_LAYER, (("dtype", "bfloat16"),))
    gm, _, _ = compile_on_fake_rank(3, {"tp": 4, "attn_exit": attn_exit}, cfg=cfg)
    inserted = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and REASON in n.meta
        and isinstance(n.meta.get("val"), torch.Tensor)
    ]
    assert inserted
    for node in inserted:  # collectives, pads and slices never change a dtype
        source = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
        assert source is not None, node.format_node()
        source_val = source.meta["val"]
        if isinstance(source_val, torch.Tensor):
            assert node.meta["val"].dtype == source_val.dtype, node.name
    # the exit: the fp32 partial reduce-scattered, or wo_b's input moved in the activation
    # dtype (wo_b then computes in fp32 on the token shard, as on one device)
    exits = [n for n in collectives(gm) if collective_kind(n) in ("reduce_scatter", "all_to_all")]
    exits = [n for n in exits if n.meta[REGION].startswith("layers.0.attn") or
             collective_kind(n) == "reduce_scatter"]  # fmt: skip
    expected = torch.float32 if attn_exit == "reduce_scatter" else torch.bfloat16
    assert [n.args[0].meta["val"].dtype for n in exits] == [expected]
    gathers = [n for n in collectives(gm) if collective_kind(n) == "all_gather"]
    assert [n.args[0].meta["val"].dtype for n in gathers] == [torch.bfloat16] * 2


def test_one_compile_serves_every_token_count():
    torch.manual_seed(0)
    model = DeepseekV41(compile_config("tiny-swa", ONE_LAYER))
    torch._dynamo.reset()
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return dsv41_compile.dsv41_sp(gm, example_inputs, options={"tp": 4, "lowering": "eager"})

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    cache = model.new_cache(16, 32)
    with fake_process_group(world_size=8, rank=0):
        for slot, T in enumerate((1, 3, 8, 13, 2)):  # includes T < tp and T % tp != 0
            ids, positions, slots = pack([Request(slot, list(range(1, T + 1)), 0)])
            dsv41_compile.mark_token_dim(ids, positions, slots)
            assert compiled(ids, positions, slots, cache).shape == (T, 512)
    assert len(frames) == 1


def test_an_int_input_next_to_t_does_not_stop_a_static_graph_generalising(monkeypatch):
    """Under dynamic=True Dynamo passes the cache's `max_len` as a symbol of its own shape env.
    A model that pads by it next to T (here: zeros added to the logits) still has its static
    T = 0 graph generalised, and matches the eager model at every step (tp = 1: a world of one
    rank, where the fake process group runs no collective)."""
    forward = DeepseekV41.forward

    def padded_by_max_len(self, input_ids, positions, slots, cache):
        n = cache.max_len
        zeros_T = torch.nn.functional.pad(positions.new_zeros(positions.shape[0]), (0, n))[n:]
        logits = forward(self, input_ids, positions, slots, cache)
        return logits + zeros_T[:, None].float()

    monkeypatch.setattr(DeepseekV41, "forward", padded_by_max_len)
    torch.manual_seed(0)
    model = DeepseekV41(compile_config("tiny-swa", ONE_LAYER))
    torch._dynamo.reset()
    options = {"tp": 1, "lowering": "eager"}
    compiled = torch.compile(model, backend="dsv41_sp", options=options, dynamic=True)
    cache, ref_cache = model.new_cache(4, 32), model.new_cache(4, 32)
    steps = ([Request(0, [1, 2, 3], 0), Request(1, [4, 5], 0)], [Request(0, [6], 3)], [])
    with fake_process_group(world_size=1, rank=0):
        for step in steps:  # T = 5 (dynamic), 1 and 0 (static graphs, generalised)
            batch = pack(step)
            got = compiled(*batch, cache)
            torch.testing.assert_close(got, model(*batch, ref_cache), atol=1e-5, rtol=1e-5)


def test_backend_is_listed_through_the_entry_point_without_importing_the_package():
    code = "import torch._dynamo, sys; sys.exit(0 if 'dsv41_sp' in torch._dynamo.list_backends() else 1)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


class TestLayerSnapshot(expecttest.TestCase):
    def test_attention_under_auto_at_twice_tiny_swa_width_tp4(self):
        """The attention block of one decoder layer (D = 128) under the default cuts: q and kv
        latents made on the token shard and gathered (the entry cut), head-sharded queries, sink
        and output groups, replicated window and cache, wo_b's input moved to its tokens' ranks
        by the exit all-to-all and projected there by the whole wo_b. The snapshot is each
        collective with the lines around it; the block's other ops are pinned by how many
        have each placement. (The rest of the layer -- mHC with its Sinkhorn iterations,
        norms, MoE -- is ~400 token-sharded pointwise nodes; the counts tests above pin its
        collectives.)"""
        cfg = compile_config("tiny-swa", ONE_LAYER, WIDE)
        gm, ctx, _ = compile_on_fake_rank(1, {"tp": 4, "rows_per_step": 4096}, cfg=cfg)
        text = layer_text(gm, ctx, "layers.0.attn")
        self.assertExpectedInline(
            collective_windows(text),
            """\
v24 = mul(layers.0.attn.kv_norm.weight, v23)  # S(0) f32[((T+3)//4), 32]
v25 = cat([v7, v24], 1)  # f32[((T+3)//4), 64]
v26 = _c10d_functional.all_gather_into_tensor(v25, 4, 'tp')  # f32[4*(((T+3)//4)), 64]  <- 2 entry gathers of layer values as one AllGather (a latency each saved): S(0) -> R: v35 in layers.0.attn needs v7 as R (dtensor (R, S(1)) -> S(1)); attn_entry='auto': 14 per-token ops on the token shard, gathered q_norm 128 + kv_norm 128 = 256 B per token row against 512 B for the input; S(0) -> R: v62 in layers.0.attn needs v24 as R
v27 = _c10d_functional.wait_tensor(v26)  # f32[4*(((T+3)//4)), 64]  <- 2 entry gathers of layer values as one AllGather (a latency each saved): S(0) -> R: v35 in layers.0.attn needs v7 as R (dtensor (R, S(1)) -> S(1)); attn_entry='auto': 14 per-token ops on the token shard, gathered q_norm 128 + kv_norm 128 = 256 B per token row against 512 B for the input; S(0) -> R: v62 in layers.0.attn needs v24 as R
v28 = split_with_sizes(v27, [32, 32], 1)  # (f32[4*(((T+3)//4)), 32], f32[4*(((T+3)//4)), 32])
v29 = getitem(v28, 1)  # f32[4*(((T+3)//4)), 32]
...
v187 = t(layers.0.attn.wo_b.weight)  # R f32[64, 128]
v188 = constant_pad_nd(v186, [0, 0, 0, in2], 0)  # f32[4*(((T+3)//4)), 16]
v189 = _c10d_functional.all_to_all_single(v188, [in4, in4, in4, in4], [in4, in4, in4, in4], 'tp')  # f32[4*(((T+3)//4)), 16]  <- S(1) -> S(0): v195 in layers.0.attn.wo_b needs v186 as S(0) (dtensor (S(0), R) -> S(0)); attn_exit='auto': all_to_all, 10.203 us per layer against 11.573 us reduce_scatter on 950dt at 4096 rows per step (10 us per collective; 48 B per token against 384 B; wo_b replicated: +24,576 B of weights per rank)
v190 = _c10d_functional.wait_tensor(v189)  # f32[4*(((T+3)//4)), 16]  <- S(1) -> S(0): v195 in layers.0.attn.wo_b needs v186 as S(0) (dtensor (S(0), R) -> S(0)); attn_exit='auto': all_to_all, 10.203 us per layer against 11.573 us reduce_scatter on 950dt at 4096 rows per step (10 us per collective; 48 B per token against 384 B; wo_b replicated: +24,576 B of weights per rank)
v191 = unflatten(v190, 0, [4, in4])  # f32[4, ((T+3)//4), 16]
v192 = permute(v191, [1, 0, 2])  # f32[((T+3)//4), 4, 16]""",
        )
        self.assertExpectedInline(
            str(placement_counts(gm, "layers.0.attn")),
            """{'(R, R)': 1, '(S(1), S(1))': 2, '-': 16, 'R': 90, 'S(0)': 24, 'S(1)': 63}""",
        )


def test_a_cache_of_another_length_compiles_with_that_length_symbolic():
    """A second cache size makes Dynamo trace the cache's length as a symbol: the
    head-sharded attention then reads its key count (W + min(k, C)) as a size, the same on
    every rank, which the layout allows (a read along the split dim it refuses)."""
    cfg = ModelConfig.from_name("tiny", hc_sinkhorn_iters=3).replace(
        n_layers=2,
        compress_ratios=(0, 2),
        kv_source_layer_ids=(1,),
        index_source_layer_ids=(1,),
        candidate_source_layer_id=-1,
        engram_layer_ids=(),
        engram_num_embeddings=(),
    )
    torch.manual_seed(0)
    model = DeepseekV41(cfg)
    with fake_process_group(8, 1), capture_programs() as programs:
        compiled = torch.compile(model, backend="dsv41_sp", options={"tp": 4, "lowering": "eager"})
        for max_len in (24, 40):
            ids, positions, slots = pack([Request(0, [1, 2, 3], 0), Request(1, [4, 5], 0)])
            dsv41_compile.mark_token_dim(ids, positions, slots)
            compiled(ids, positions, slots, model.new_cache(2, max_len))
    assert len(programs) == 2
    (second, _) = programs[1]
    sizes = [n for n in second.graph.nodes if n.target is torch.ops.aten.sym_size.int]
    assert any(n.args[0].meta["val"].dim() == 3 and n.args[1] == 2 for n in sizes)


def _walk_of_a_compile(compile_one) -> list[tuple[str, str, str, str]]:
    """Every call of a function of the package made while `dsv41_sp` runs, as (its module, the
    module of the package's nearest frame below it on the stack, its name, the module of the
    frame that called it, torch's included)."""
    calls: list[tuple[str, str, str, str]] = []
    inside = [0]

    def package_module(frame) -> str:
        name = frame.f_globals.get("__name__", "")
        return name if name.startswith("dsv41_compile.") else ""

    def profile(frame, event, arg):
        if event not in ("call", "return") or not package_module(frame):
            return
        entry = frame.f_code is dsv41_compile.backend.dsv41_sp.__code__
        if entry:
            inside[0] += 1 if event == "call" else -1
        if event != "call" or not inside[0] or entry:
            return
        caller = frame.f_back
        immediate = caller.f_globals.get("__name__", "") if caller is not None else ""
        while caller is not None and not package_module(caller):
            caller = caller.f_back
        name = frame.f_code.co_name
        calls.append((package_module(frame), package_module(caller), name, immediate))

    sys.setprofile(profile)
    try:
        compile_one()
    finally:
        sys.setprofile(None)
    return calls


def test_a_compile_walks_down_from_the_entry_module_and_never_back():
    """From `dsv41_sp` a compile goes down the layers: nothing calls back into `backend.py` (a
    compiler AOTAutograd calls, a host-cache callback), and the front porch (`frontend/` and the
    regions it traces) is entered from `backend.py` alone, as its two steps and their results:
    `capture`, then `trace` (and before them `computes_no_tensor`: whether Dynamo's graph is
    one of no tensor op, handed over where the model refused a call)."""
    with toy_family():
        calls = _walk_of_a_compile(
            lambda: compile_model_on_fake_rank(ToyLM(), (torch.arange(8),), {"tp": 4})
        )
    backend = "dsv41_compile.backend"
    assert len(calls) > 1000  # the profile saw the compile
    climbs = {(caller, name) for module, _, name, caller in calls if module == backend}
    climbs -= {(backend, name) for _, _, name, _ in calls}
    assert climbs == set(), f"called back into backend.py: {sorted(climbs)}"

    def porch(module: str) -> bool:
        return module.startswith("dsv41_compile.frontend")

    entries = {(caller, name) for module, caller, name, _ in calls if porch(module)}
    entries = {(caller, name) for caller, name in entries if not porch(caller)}
    assert {caller for caller, _ in entries} == {backend}, sorted(entries)
    steps = {"computes_no_tensor", "capture", "trace"}
    results = {"param_shapes", "planning", "bind"}  # what the steps' results answer
    assert steps <= {name for _, name in entries} <= steps | results, sorted(entries)
