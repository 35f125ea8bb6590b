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
from dsv41_compile.core.mesh import clear_mesh_cache
from dsv41_compile.core.meta import GLOBAL_VAL, OUT, REASON, REGION, module_paths
from dsv41_compile.model import DeepseekV41
from dsv41_compile.report.comm import collective_kind
from dsv41_compile.report.dump import graph_labels
from dsv41_compile.report.graph_printer import format_graph
from dsv41_compile.testing.batches import Request, pack
from dsv41_compile.testing.fake_rank import compile_on_fake_rank, layer_text
from dsv41_compile.testing.presets import ONE_LAYER, WIDE, compile_config
from dsv41_compile.testing.torch_shims import fake_process_group


@pytest.fixture(scope="module")
def rank1():
    return compile_on_fake_rank(1, {"tp": 4})


@pytest.fixture(scope="module")
def seed_rank1():
    """The requirement's layout exactly: the input gathered, the wo_b partial reduce-scattered."""
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


def test_auto_exits_attention_with_an_all_to_all_of_wo_bs_input(rank1):
    """tiny-swa, tp=4: of wo_a's output [T, 64] (fp32 here) each rank holds 16 columns; the all-to-all moves 3/4 x 16 x 4 = 48 B per token against the ReduceScatter's
    3/4 x 64 x 4 = 192 B, and wo_b (64 x 64 fp32) is replicated: 3/4 of it, 12,288 B, more per layer and rank."""
    gm, ctx, logits = rank1
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
                "; attn_exit='auto': all_to_all, 48 B per token against 192 B "
                "reduce_scatter; wo_b replicated: +24,576 B of weights per rank"
            )
    assert ctx.options.attn_exit == "all_to_all"
    wo_b = [s for s in ctx.param_shards.values() if s.fqn.endswith("wo_b.weight")]
    assert wo_b == []  # whole on every rank
    assert not any(collective_kind(n) in ("reduce_scatter", "all_reduce") for n in gm.graph.nodes)


@pytest.fixture(scope="module")
def wide_rank1():
    """One window-only layer at twice tiny's width (D = 128), the default options."""
    return compile_on_fake_rank(1, {"tp": 4}, cfg=compile_config("tiny-swa", ONE_LAYER, WIDE))


def test_auto_entry_gathers_the_q_and_kv_latents_where_they_are_narrower(wide_rank1):
    """D = 128: wq_a -> q_norm and wkv -> kv_norm run on the token shard and their [Tl, 32]
    fp32 outputs are gathered, 2 x 128 B per token row against the input's 512 B; the input
    itself is not gathered. The ops after them (head-sharded wq_b, rope, the window, the cache
    write) see all T rows, as before."""
    gm, ctx, logits = wide_rank1
    assert logits.shape == (8, 512)
    gathers = [n for n in collectives(gm) if n.meta[REGION] == "layers.0.attn"]
    assert [collective_kind(n) for n in gathers] == ["all_gather", "all_gather"]
    sources = [n.args[0] for n in gathers]
    assert [module_paths(s)[-1] for s in sources] == [
        "layers.0.attn.q_norm", "layers.0.attn.kv_norm",
    ]  # fmt: skip
    for source in sources:
        assert (source.meta[OUT], source.meta["val"].dtype) == (Shard(0), torch.float32)
        assert source.meta[GLOBAL_VAL].shape[1:] == (32,)
    cut = ctx.entry_cuts["layers.0.attn"]
    assert cut.gathered == tuple(sources) and cut.row_bytes == (128, 128)
    assert cut.input_row_bytes == 128 * 4
    why = (
        "attn_entry='auto': 14 per-token ops on the token shard, gathered q_norm 128 + kv_norm "
        "128 = 256 B per token row against 512 B for the input"
    )
    for node in gathers:
        assert node.meta[REASON].endswith(f"; {why}"), node.meta[REASON]
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
    collectives: the input, the requirement's layout. attn_entry="input" plans no cut."""
    _, ctx, _ = rank1
    for layer in (0, 1):
        cut = ctx.entry_cuts[f"layers.{layer}.attn"]
        assert not cut.sharded and cut.input_row_bytes == 256
        assert ctx.choices[f"layers.{layer}.attn"] == (
            "attn_entry='auto': the input, 256 B per token row, against 256 B for the cheapest cut"
        )
    _, seed_ctx, _ = seed_rank1
    assert seed_ctx.plan.entry_cuts == () and seed_ctx.entry_cuts == {}


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
    assert [collective_kind(n) for n in rest] == ["all_gather", "all_to_all", "all_gather"]


def test_dump_writes_graph_and_comm_records(rank6_dumped):
    *_, dump = rank6_dumped
    graph = (dump / "rank6" / "graph.py").read_text()
    assert "_c10d_functional.all_gather_into_tensor(" in graph and "<- S(0) -> R" in graph
    comm = json.loads((dump / "rank6" / "comm.json").read_text())
    assert (comm["rank"], comm["tp_rank"], comm["dp_rank"]) == (6, 2, 1)
    kinds = [c["kind"] for c in comm["collectives"]]
    assert kinds == ["all_gather", "all_to_all"] * 2 + ["all_gather"]
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
        clear_mesh_cache()
        for slot, T in enumerate((1, 3, 8, 13, 2)):  # includes T < tp and T % tp != 0
            ids, positions, slots = pack([Request(slot, list(range(1, T + 1)), 0)])
            dsv41_compile.mark_token_dim(ids, positions, slots)
            assert compiled(ids, positions, slots, cache).shape == (T, 512)
        clear_mesh_cache()
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
        clear_mesh_cache()
        for step in steps:  # T = 5 (dynamic), 1 and 0 (static graphs, generalised)
            batch = pack(step)
            got = compiled(*batch, cache)
            torch.testing.assert_close(got, model(*batch, ref_cache), atol=1e-5, rtol=1e-5)
        clear_mesh_cache()


def test_backend_is_listed_through_the_entry_point_without_importing_the_package():
    code = "import torch._dynamo, sys; sys.exit(0 if 'dsv41_sp' in torch._dynamo.list_backends() else 1)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


class TestLayerSnapshot(expecttest.TestCase):
    def test_attention_under_auto_at_twice_tiny_swa_width_tp4(self):
        """The attention block of one decoder layer (D = 128) under the default cuts: q and kv
        latents made on the token shard and gathered (the entry cut), head-sharded queries, sink
        and output groups, replicated window and cache, wo_b's input moved to its tokens' ranks
        by the exit all-to-all and projected there by the whole wo_b. (The rest of the layer --
        mHC with its Sinkhorn iterations, norms, MoE -- is ~400 token-sharded pointwise nodes;
        the counts tests above pin its collectives.)"""
        cfg = compile_config("tiny-swa", ONE_LAYER, WIDE)
        gm, ctx, _ = compile_on_fake_rank(1, {"tp": 4}, cfg=cfg)
        self.assertExpectedInline(
            layer_text(gm, ctx, "layers.0.attn"),
            """\
v0 = _assert_scalar(in0, "Runtime assertion failed for expression u2 >= 0 on node 'ge_5'")
v1 = eq(input_ids.size()[0], positions.size()[0])  # True
v2 = _assert_scalar(v1, "Runtime assertion failed for expression Eq(u0, u2) on node 'eq_1'")
v3 = _assert_scalar(v1, "Runtime assertion failed for expression Eq(u1, u2) on node 'eq_2'")
v4 = t(layers.0.attn.wq_a.weight)  # R f32[128, 32]
v5 = mm(in1, v4)  # S(0) f32[((T+3)//4), 32]
v6 = pow(v5, 2)  # S(0) f32[((T+3)//4), 32]
v7 = mean(v6, [-1], True)  # S(0) f32[((T+3)//4), 1]
v8 = add(v7, 1e-06)  # S(0) f32[((T+3)//4), 1]
v9 = rsqrt(v8)  # S(0) f32[((T+3)//4), 1]
v10 = mul(v5, v9)  # S(0) f32[((T+3)//4), 32]
v11 = mul(layers.0.attn.q_norm.weight, v10)  # S(0) f32[((T+3)//4), 32]
v12 = t(layers.0.attn.wq_b.weight)  # S(1) f32[32, 64]
v13 = _c10d_functional.all_gather_into_tensor(v11, 4, 'tp')  # f32[4*(((T+3)//4)), 32]  <- S(0) -> R: v17 in layers.0.attn needs v11 as R (dtensor (R, S(1)) -> S(1)); attn_entry='auto': 14 per-token ops on the token shard, gathered q_norm 128 + kv_norm 128 = 256 B per token row against 512 B for the input
v14 = _c10d_functional.wait_tensor(v13)  # f32[4*(((T+3)//4)), 32]  <- S(0) -> R: v17 in layers.0.attn needs v11 as R (dtensor (R, S(1)) -> S(1)); attn_entry='auto': 14 per-token ops on the token shard, gathered q_norm 128 + kv_norm 128 = 256 B per token row against 512 B for the input
v15 = split_with_sizes(v14, [in2, in3])  # (f32[T, 32], f32[-T+4*(((T+3)//4)), 32])
v16 = getitem(v15, 0)  # R f32[T, 32]
v17 = mm(v16, v12)  # S(1) f32[T, 64]
v18 = view(v17, [positions.size()[0], 2, 32])  # S(1) f32[T, 2, 32]
v19 = _to_copy(positions, dtype=f32)  # R f32[T]
v20 = slice(v19, 0, 0, end)  # R f32[T]
v21 = unsqueeze(v20, 1)  # R f32[T, 1]
v22 = unsqueeze(layers.0.attn.rope_inv_freq, 0)  # R f32[1, 4]
v23 = mul(v21, v22)  # R f32[T, 4]
v24 = view(v23, [positions.size()[0], 1, 4])  # R f32[T, 1, 4]
v25 = cos(v24)  # R f32[T, 1, 4]
v26 = sin(v24)  # R f32[T, 1, 4]
v27 = slice(v18, 2, -8, end)  # S(1) f32[T, 2, 8]
v28 = view(v27, [positions.size()[0], 2, 4, 2])  # S(1) f32[T, 2, 4, 2]
v29 = unbind(v28, -1)  # (S(1), S(1)) (f32[T, 2, 4], f32[T, 2, 4])
v30 = getitem(v29, 0)  # S(1) f32[T, 2, 4]
v31 = getitem(v29, 1)  # S(1) f32[T, 2, 4]
v32 = mul(v30, v25)  # S(1) f32[T, 2, 4]
v33 = mul(v31, v26)  # S(1) f32[T, 2, 4]
v34 = sub(v32, v33)  # S(1) f32[T, 2, 4]
v35 = mul(v30, v26)  # S(1) f32[T, 2, 4]
v36 = mul(v31, v25)  # S(1) f32[T, 2, 4]
v37 = add(v35, v36)  # S(1) f32[T, 2, 4]
v38 = stack([v34, v37], -1)  # S(1) f32[T, 2, 4, 2]
v39 = view(v38, [positions.size()[0], 2, 8])  # S(1) f32[T, 2, 8]
v40 = slice(v18, 2, 0, -8)  # S(1) f32[T, 2, 24]
v41 = cat([v40, v39], -1)  # S(1) f32[T, 2, 32]
v42 = t(layers.0.attn.wkv.weight)  # R f32[128, 32]
v43 = mm(in1, v42)  # S(0) f32[((T+3)//4), 32]
v44 = pow(v43, 2)  # S(0) f32[((T+3)//4), 32]
v45 = mean(v44, [-1], True)  # S(0) f32[((T+3)//4), 1]
v46 = add(v45, 1e-06)  # S(0) f32[((T+3)//4), 1]
v47 = rsqrt(v46)  # S(0) f32[((T+3)//4), 1]
v48 = mul(v43, v47)  # S(0) f32[((T+3)//4), 32]
v49 = mul(layers.0.attn.kv_norm.weight, v48)  # S(0) f32[((T+3)//4), 32]
v50 = _to_copy(positions, dtype=f32)  # R f32[T]
v51 = slice(v50, 0, 0, end)  # R f32[T]
v52 = unsqueeze(v51, 1)  # R f32[T, 1]
v53 = unsqueeze(layers.0.attn.rope_inv_freq, 0)  # R f32[1, 4]
v54 = mul(v52, v53)  # R f32[T, 4]
v55 = view(v54, [positions.size()[0], 4])  # R f32[T, 4]
v56 = cos(v55)  # R f32[T, 4]
v57 = sin(v55)  # R f32[T, 4]
v58 = _c10d_functional.all_gather_into_tensor(v49, 4, 'tp')  # f32[4*(((T+3)//4)), 32]  <- S(0) -> R: v62 in layers.0.attn needs v49 as R; attn_entry='auto': 14 per-token ops on the token shard, gathered q_norm 128 + kv_norm 128 = 256 B per token row against 512 B for the input
v59 = _c10d_functional.wait_tensor(v58)  # f32[4*(((T+3)//4)), 32]  <- S(0) -> R: v62 in layers.0.attn needs v49 as R; attn_entry='auto': 14 per-token ops on the token shard, gathered q_norm 128 + kv_norm 128 = 256 B per token row against 512 B for the input
v60 = split_with_sizes(v59, [in2, in3])  # (f32[T, 32], f32[-T+4*(((T+3)//4)), 32])
v61 = getitem(v60, 0)  # R f32[T, 32]
v62 = slice(v61, 1, -8, end)  # R f32[T, 8]
v63 = view(v62, [positions.size()[0], 4, 2])  # R f32[T, 4, 2]
v64 = unbind(v63, -1)  # (R, R) (f32[T, 4], f32[T, 4])
v65 = getitem(v64, 0)  # R f32[T, 4]
v66 = getitem(v64, 1)  # R f32[T, 4]
v67 = mul(v65, v56)  # R f32[T, 4]
v68 = mul(v66, v57)  # R f32[T, 4]
v69 = sub(v67, v68)  # R f32[T, 4]
v70 = mul(v65, v57)  # R f32[T, 4]
v71 = mul(v66, v56)  # R f32[T, 4]
v72 = add(v70, v71)  # R f32[T, 4]
v73 = stack([v69, v72], -1)  # R f32[T, 4, 2]
v74 = view(v73, [positions.size()[0], 8])  # R f32[T, 8]
v75 = slice(v61, 1, 0, -8)  # R f32[T, 24]
v76 = cat([v75, v74], -1)  # R f32[T, 32]
v77 = eq(in4, 4)  # R b8[T]
v78 = clamp(in4, None, 3)  # R i64[T]
v79 = index(cache.lengths, [v78])  # R i64[T]
v80 = where(v77, positions, v79)  # R i64[T]
v81 = arange(4, pin_memory=False)  # R i64[4]
v82 = sub(v81, 3)  # R i64[4]
v83 = slice(positions, 0, 0, end)  # R i64[T]
v84 = unsqueeze(v83, 1)  # R i64[T, 1]
v85 = add(v84, v82)  # R i64[T, 4]
v86 = arange(positions.size()[0], pin_memory=False)  # R i64[T]
v87 = slice(v86, 0, 0, end)  # R i64[T]
v88 = unsqueeze(v87, 1)  # R i64[T, 1]
v89 = add(v88, v82)  # R i64[T, 4]
v90 = clamp(v89, 0)  # R i64[T, 4]
v91 = slice(in4, 0, 0, end)  # R i64[T]
v92 = unsqueeze(v91, 1)  # R i64[T, 1]
v93 = clamp(v85, 0)  # R i64[T, 4]
v94 = remainder(v93, 4)  # R i64[T, 4]
v95 = index(cache.window_kv[0], [v92, v94])  # R f32[T, 4, 32]
v96 = slice(v80, 0, 0, end)  # R i64[T]
v97 = unsqueeze(v96, 1)  # R i64[T, 1]
v98 = ge(v85, v97)  # R b8[T, 4]
v99 = unsqueeze(v98, 2)  # R b8[T, 4, 1]
v100 = index(v76, [v90])  # R f32[T, 4, 32]
v101 = where(v99, v100, v95)  # R f32[T, 4, 32]
v102 = ge(v85, 0)  # R b8[T, 4]
v103 = constant_pad_nd(in4, [0, 4], -1.0)  # R i64[T+4]
v104 = slice(v103, 0, 4, end)  # R i64[T]
v105 = ne(v104, in4)  # R b8[T]
v106 = scalar_tensor(4, dtype=i64, layout=torch.strided)  # R i64[]
v107 = where(v105, in4, v106)  # R i64[T]
v108 = remainder(positions, 4)  # R i64[T]
v109 = scalar_tensor(0, dtype=i64, layout=torch.strided)  # R i64[]
v110 = where(v105, v108, v109)  # R i64[T]
v111 = index_put(cache.window_kv[0], [v107, v110], v76)  # R f32[5, 4, 32]
v112 = unsqueeze(v41, 3)  # S(1) f32[T, 2, 32, 1]
v113 = permute(v112, [0, 1, 3, 2])  # S(1) f32[T, 2, 1, 32]
v114 = unsqueeze(v101, 3)  # R f32[T, 4, 32, 1]
v115 = permute(v114, [0, 3, 1, 2])  # R f32[T, 1, 4, 32]
v116 = permute(v113, [0, 1, 3, 2])  # S(1) f32[T, 2, 32, 1]
v117 = view(v116, [positions.size()[0], 2, 32])  # S(1) f32[T, 2, 32]
v118 = permute(v115, [0, 3, 2, 1])  # R f32[T, 32, 4, 1]
v119 = view(v118, [positions.size()[0], 32, 4])  # R f32[T, 32, 4]
v120 = bmm(v117, v119)  # S(1) f32[T, 2, 4]
v121 = view(v120, [positions.size()[0], 2, 1, 4])  # S(1) f32[T, 2, 1, 4]
v122 = permute(v121, [0, 1, 3, 2])  # S(1) f32[T, 2, 4, 1]
v123 = view(v122, [positions.size()[0], 2, 4])  # S(1) f32[T, 2, 4]
v124 = mul(v123, 0.1767766952966369)  # S(1) f32[T, 2, 4]
v125 = slice(v102, 0, 0, end)  # R b8[T, 4]
v126 = unsqueeze(v125, 1)  # R b8[T, 1, 4]
v127 = bitwise_not(v126)  # R b8[T, 1, 4]
v128 = masked_fill(v124, v127, -inf)  # S(1) f32[T, 2, 4]
v129 = unsqueeze(layers.0.attn.attn_sink, 0)  # S(1) f32[1, 2]
v130 = unsqueeze(v129, 2)  # S(1) f32[1, 2, 1]
v131 = expand(v130, [positions.size()[0], -1, 1])  # S(1) f32[T, 2, 1]
v132 = cat([v128, v131], -1)  # S(1) f32[T, 2, 5]
v133 = _softmax(v132, -1, False)  # S(1) f32[T, 2, 5]
v134 = slice(v133, 2, 0, -1)  # S(1) f32[T, 2, 4]
v135 = unsqueeze(v134, 3)  # S(1) f32[T, 2, 4, 1]
v136 = permute(v135, [0, 1, 3, 2])  # S(1) f32[T, 2, 1, 4]
v137 = unsqueeze(v101, 3)  # R f32[T, 4, 32, 1]
v138 = permute(v137, [0, 3, 2, 1])  # R f32[T, 1, 32, 4]
v139 = permute(v136, [0, 1, 3, 2])  # S(1) f32[T, 2, 4, 1]
v140 = view(v139, [positions.size()[0], 2, 4])  # S(1) f32[T, 2, 4]
v141 = permute(v138, [0, 3, 2, 1])  # R f32[T, 4, 32, 1]
v142 = view(v141, [positions.size()[0], 4, 32])  # R f32[T, 4, 32]
v143 = bmm(v140, v142)  # S(1) f32[T, 2, 32]
v144 = view(v143, [positions.size()[0], 2, 1, 32])  # S(1) f32[T, 2, 1, 32]
v145 = permute(v144, [0, 1, 3, 2])  # S(1) f32[T, 2, 32, 1]
v146 = view(v145, [positions.size()[0], 2, 32])  # S(1) f32[T, 2, 32]
v147 = _to_copy(positions, dtype=f32)  # R f32[T]
v148 = slice(v147, 0, 0, end)  # R f32[T]
v149 = unsqueeze(v148, 1)  # R f32[T, 1]
v150 = unsqueeze(layers.0.attn.rope_inv_freq, 0)  # R f32[1, 4]
v151 = mul(v149, v150)  # R f32[T, 4]
v152 = view(v151, [positions.size()[0], 1, 4])  # R f32[T, 1, 4]
v153 = cos(v152)  # R f32[T, 1, 4]
v154 = sin(v152)  # R f32[T, 1, 4]
v155 = neg(v154)  # R f32[T, 1, 4]
v156 = slice(v146, 2, -8, end)  # S(1) f32[T, 2, 8]
v157 = view(v156, [positions.size()[0], 2, 4, 2])  # S(1) f32[T, 2, 4, 2]
v158 = unbind(v157, -1)  # (S(1), S(1)) (f32[T, 2, 4], f32[T, 2, 4])
v159 = getitem(v158, 0)  # S(1) f32[T, 2, 4]
v160 = getitem(v158, 1)  # S(1) f32[T, 2, 4]
v161 = mul(v159, v153)  # S(1) f32[T, 2, 4]
v162 = mul(v160, v155)  # S(1) f32[T, 2, 4]
v163 = sub(v161, v162)  # S(1) f32[T, 2, 4]
v164 = mul(v159, v155)  # S(1) f32[T, 2, 4]
v165 = mul(v160, v153)  # S(1) f32[T, 2, 4]
v166 = add(v164, v165)  # S(1) f32[T, 2, 4]
v167 = stack([v163, v166], -1)  # S(1) f32[T, 2, 4, 2]
v168 = view(v167, [positions.size()[0], 2, 8])  # S(1) f32[T, 2, 8]
v169 = slice(v146, 2, 0, -8)  # S(1) f32[T, 2, 24]
v170 = cat([v169, v168], -1)  # S(1) f32[T, 2, 32]
v171 = view(layers.0.attn.wo_a.weight, [1, 16, 64])  # S(0) f32[1, 16, 64]
v172 = view(v170, [positions.size()[0], 1, 64])  # S(1) f32[T, 1, 64]
v173 = unsqueeze(v172, 3)  # S(1) f32[T, 1, 64, 1]
v174 = permute(v173, [0, 1, 3, 2])  # S(1) f32[T, 1, 1, 64]
v175 = unsqueeze(v171, 3)  # S(0) f32[1, 16, 64, 1]
v176 = permute(v175, [3, 0, 1, 2])  # S(1) f32[1, 1, 16, 64]
v177 = permute(v174, [1, 0, 3, 2])  # S(0) f32[1, T, 64, 1]
v178 = view(v177, [1, positions.size()[0], 64])  # S(0) f32[1, T, 64]
v179 = permute(v176, [1, 3, 2, 0])  # S(0) f32[1, 64, 16, 1]
v180 = view(v179, [1, 64, 16])  # S(0) f32[1, 64, 16]
v181 = bmm(v178, v180)  # S(0) f32[1, T, 16]
v182 = view(v181, [1, positions.size()[0], 1, 16])  # S(0) f32[1, T, 1, 16]
v183 = permute(v182, [1, 0, 3, 2])  # S(1) f32[T, 1, 16, 1]
v184 = view(v183, [positions.size()[0], 1, 16])  # S(1) f32[T, 1, 16]
v185 = clone(v184, memory_format=torch.contiguous_format)  # S(1) f32[T, 1, 16]
v186 = _unsafe_view(v185, [positions.size()[0], 16])  # S(1) f32[T, 16]
v187 = t(layers.0.attn.wo_b.weight)  # R f32[64, 128]
v188 = constant_pad_nd(v186, [0, 0, 0, in3], 0)  # f32[4*(((T+3)//4)), 16]
v189 = _c10d_functional.all_to_all_single(v188, [in5, in5, in5, in5], [in5, in5, in5, in5], 'tp')  # f32[4*(((T+3)//4)), 16]  <- S(1) -> S(0): v195 in layers.0.attn.wo_b needs v186 as S(0) (dtensor (S(0), R) -> S(0)); attn_exit='auto': all_to_all, 48 B per token against 384 B reduce_scatter; wo_b replicated: +24,576 B of weights per rank
v190 = _c10d_functional.wait_tensor(v189)  # f32[4*(((T+3)//4)), 16]  <- S(1) -> S(0): v195 in layers.0.attn.wo_b needs v186 as S(0) (dtensor (S(0), R) -> S(0)); attn_exit='auto': all_to_all, 48 B per token against 384 B reduce_scatter; wo_b replicated: +24,576 B of weights per rank
v191 = unflatten(v190, 0, [4, in5])  # f32[4, ((T+3)//4), 16]
v192 = permute(v191, [1, 0, 2])  # f32[((T+3)//4), 4, 16]
v193 = clone(v192, memory_format=torch.contiguous_format)  # f32[((T+3)//4), 4, 16]
v194 = view(v193, [-1, 64])  # S(0) f32[((T+3)//4), 64]
v195 = mm(v194, v187)  # S(0) f32[((T+3)//4), 128]""",
        )
