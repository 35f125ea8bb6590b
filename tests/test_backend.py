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

import dsv41_compile
from dsv41_compile.core.mesh import clear_mesh_cache
from dsv41_compile.core.meta import REASON, REGION
from dsv41_compile.model import DeepseekV41
from dsv41_compile.report.comm import collective_kind
from dsv41_compile.report.dump import graph_labels
from dsv41_compile.report.graph_printer import format_graph
from dsv41_compile.testing.batches import Request, pack
from dsv41_compile.testing.fake_rank import compile_on_fake_rank, layer_text
from dsv41_compile.testing.presets import ONE_LAYER, compile_config
from dsv41_compile.testing.torch_shims import fake_process_group


@pytest.fixture(scope="module")
def rank1():
    return compile_on_fake_rank(1, {"tp": 4})


@pytest.fixture(scope="module")
def seed_rank1():
    """The requirement's layout exactly: the wo_b partial reduce-scattered."""
    return compile_on_fake_rank(1, {"tp": 4, "attn_exit": "reduce_scatter"})


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
    def test_attention_of_layer_1_of_tiny_swa_tp4(self):
        """The attention block of one decoder layer: all-gathered input, head-sharded queries,
        sink and output groups, replicated latent KV and cache, the fp32 partial of wo_b. (The
        rest of the layer -- mHC with its Sinkhorn iterations, norms, MoE -- is ~400 token-sharded
        pointwise nodes; the counts test above pins its collectives.)"""
        gm, ctx, _ = compile_on_fake_rank(1, {"tp": 4})
        self.assertExpectedInline(
            layer_text(gm, ctx, "layers.1.attn"),
            """\
v0 = t(layers.1.attn.wq_a.weight)  # R f32[64, 32]
v1 = _c10d_functional.all_gather_into_tensor(in0, 4, 'tp')  # f32[4*(((T+3)//4)), 64]  <- S(0) -> R: v5 in layers.1.attn needs in0 as R
v2 = _c10d_functional.wait_tensor(v1)  # f32[4*(((T+3)//4)), 64]  <- S(0) -> R: v5 in layers.1.attn needs in0 as R
v3 = split_with_sizes(v2, [in1, in2])  # (f32[T, 64], f32[-T+4*(((T+3)//4)), 64])
v4 = getitem(v3, 0)  # R f32[T, 64]
v5 = mm(v4, v0)  # R f32[T, 32]
v6 = pow(v5, 2)  # R f32[T, 32]
v7 = mean(v6, [-1], True)  # R f32[T, 1]
v8 = add(v7, 1e-06)  # R f32[T, 1]
v9 = rsqrt(v8)  # R f32[T, 1]
v10 = mul(v5, v9)  # R f32[T, 32]
v11 = mul(layers.1.attn.q_norm.weight, v10)  # R f32[T, 32]
v12 = t(layers.1.attn.wq_b.weight)  # S(1) f32[32, 64]
v13 = mm(v11, v12)  # S(1) f32[T, 64]
v14 = view(v13, [positions.size()[0], 2, 32])  # S(1) f32[T, 2, 32]
v15 = _to_copy(positions, dtype=f32)  # R f32[T]
v16 = slice(v15, 0, 0, end)  # R f32[T]
v17 = unsqueeze(v16, 1)  # R f32[T, 1]
v18 = unsqueeze(layers.1.attn.rope_inv_freq, 0)  # R f32[1, 4]
v19 = mul(v17, v18)  # R f32[T, 4]
v20 = view(v19, [positions.size()[0], 1, 4])  # R f32[T, 1, 4]
v21 = cos(v20)  # R f32[T, 1, 4]
v22 = sin(v20)  # R f32[T, 1, 4]
v23 = slice(v14, 2, -8, end)  # S(1) f32[T, 2, 8]
v24 = view(v23, [positions.size()[0], 2, 4, 2])  # S(1) f32[T, 2, 4, 2]
v25 = unbind(v24, -1)  # (S(1), S(1)) (f32[T, 2, 4], f32[T, 2, 4])
v26 = getitem(v25, 0)  # S(1) f32[T, 2, 4]
v27 = getitem(v25, 1)  # S(1) f32[T, 2, 4]
v28 = mul(v26, v21)  # S(1) f32[T, 2, 4]
v29 = mul(v27, v22)  # S(1) f32[T, 2, 4]
v30 = sub(v28, v29)  # S(1) f32[T, 2, 4]
v31 = mul(v26, v22)  # S(1) f32[T, 2, 4]
v32 = mul(v27, v21)  # S(1) f32[T, 2, 4]
v33 = add(v31, v32)  # S(1) f32[T, 2, 4]
v34 = stack([v30, v33], -1)  # S(1) f32[T, 2, 4, 2]
v35 = view(v34, [positions.size()[0], 2, 8])  # S(1) f32[T, 2, 8]
v36 = slice(v14, 2, 0, -8)  # S(1) f32[T, 2, 24]
v37 = cat([v36, v35], -1)  # S(1) f32[T, 2, 32]
v38 = t(layers.1.attn.wkv.weight)  # R f32[64, 32]
v39 = mm(v4, v38)  # R f32[T, 32]
v40 = pow(v39, 2)  # R f32[T, 32]
v41 = mean(v40, [-1], True)  # R f32[T, 1]
v42 = add(v41, 1e-06)  # R f32[T, 1]
v43 = rsqrt(v42)  # R f32[T, 1]
v44 = mul(v39, v43)  # R f32[T, 32]
v45 = mul(layers.1.attn.kv_norm.weight, v44)  # R f32[T, 32]
v46 = _to_copy(positions, dtype=f32)  # R f32[T]
v47 = slice(v46, 0, 0, end)  # R f32[T]
v48 = unsqueeze(v47, 1)  # R f32[T, 1]
v49 = unsqueeze(layers.1.attn.rope_inv_freq, 0)  # R f32[1, 4]
v50 = mul(v48, v49)  # R f32[T, 4]
v51 = view(v50, [positions.size()[0], 4])  # R f32[T, 4]
v52 = cos(v51)  # R f32[T, 4]
v53 = sin(v51)  # R f32[T, 4]
v54 = slice(v45, 1, -8, end)  # R f32[T, 8]
v55 = view(v54, [positions.size()[0], 4, 2])  # R f32[T, 4, 2]
v56 = unbind(v55, -1)  # (R, R) (f32[T, 4], f32[T, 4])
v57 = getitem(v56, 0)  # R f32[T, 4]
v58 = getitem(v56, 1)  # R f32[T, 4]
v59 = mul(v57, v52)  # R f32[T, 4]
v60 = mul(v58, v53)  # R f32[T, 4]
v61 = sub(v59, v60)  # R f32[T, 4]
v62 = mul(v57, v53)  # R f32[T, 4]
v63 = mul(v58, v52)  # R f32[T, 4]
v64 = add(v62, v63)  # R f32[T, 4]
v65 = stack([v61, v64], -1)  # R f32[T, 4, 2]
v66 = view(v65, [positions.size()[0], 8])  # R f32[T, 8]
v67 = slice(v45, 1, 0, -8)  # R f32[T, 24]
v68 = cat([v67, v66], -1)  # R f32[T, 32]
v69 = eq(in3, 4)  # R b8[T]
v70 = clamp(in3, None, 3)  # R i64[T]
v71 = index(cache.lengths, [v70])  # R i64[T]
v72 = where(v69, positions, v71)  # R i64[T]
v73 = arange(4, pin_memory=False)  # R i64[4]
v74 = sub(v73, 3)  # R i64[4]
v75 = slice(positions, 0, 0, end)  # R i64[T]
v76 = unsqueeze(v75, 1)  # R i64[T, 1]
v77 = add(v76, v74)  # R i64[T, 4]
v78 = arange(positions.size()[0], pin_memory=False)  # R i64[T]
v79 = slice(v78, 0, 0, end)  # R i64[T]
v80 = unsqueeze(v79, 1)  # R i64[T, 1]
v81 = add(v80, v74)  # R i64[T, 4]
v82 = clamp(v81, 0)  # R i64[T, 4]
v83 = slice(in3, 0, 0, end)  # R i64[T]
v84 = unsqueeze(v83, 1)  # R i64[T, 1]
v85 = clamp(v77, 0)  # R i64[T, 4]
v86 = remainder(v85, 4)  # R i64[T, 4]
v87 = index(cache.window_kv[1], [v84, v86])  # R f32[T, 4, 32]
v88 = slice(v72, 0, 0, end)  # R i64[T]
v89 = unsqueeze(v88, 1)  # R i64[T, 1]
v90 = ge(v77, v89)  # R b8[T, 4]
v91 = unsqueeze(v90, 2)  # R b8[T, 4, 1]
v92 = index(v68, [v82])  # R f32[T, 4, 32]
v93 = where(v91, v92, v87)  # R f32[T, 4, 32]
v94 = ge(v77, 0)  # R b8[T, 4]
v95 = constant_pad_nd(in3, [0, 4], -1.0)  # R i64[T+4]
v96 = slice(v95, 0, 4, end)  # R i64[T]
v97 = ne(v96, in3)  # R b8[T]
v98 = scalar_tensor(4, dtype=i64, layout=torch.strided)  # R i64[]
v99 = where(v97, in3, v98)  # R i64[T]
v100 = remainder(positions, 4)  # R i64[T]
v101 = scalar_tensor(0, dtype=i64, layout=torch.strided)  # R i64[]
v102 = where(v97, v100, v101)  # R i64[T]
v103 = index_put(cache.window_kv[1], [v99, v102], v68)  # R f32[5, 4, 32]
v104 = unsqueeze(v37, 3)  # S(1) f32[T, 2, 32, 1]
v105 = permute(v104, [0, 1, 3, 2])  # S(1) f32[T, 2, 1, 32]
v106 = unsqueeze(v93, 3)  # R f32[T, 4, 32, 1]
v107 = permute(v106, [0, 3, 1, 2])  # R f32[T, 1, 4, 32]
v108 = permute(v105, [0, 1, 3, 2])  # S(1) f32[T, 2, 32, 1]
v109 = view(v108, [positions.size()[0], 2, 32])  # S(1) f32[T, 2, 32]
v110 = permute(v107, [0, 3, 2, 1])  # R f32[T, 32, 4, 1]
v111 = view(v110, [positions.size()[0], 32, 4])  # R f32[T, 32, 4]
v112 = bmm(v109, v111)  # S(1) f32[T, 2, 4]
v113 = view(v112, [positions.size()[0], 2, 1, 4])  # S(1) f32[T, 2, 1, 4]
v114 = permute(v113, [0, 1, 3, 2])  # S(1) f32[T, 2, 4, 1]
v115 = view(v114, [positions.size()[0], 2, 4])  # S(1) f32[T, 2, 4]
v116 = mul(v115, 0.1767766952966369)  # S(1) f32[T, 2, 4]
v117 = slice(v94, 0, 0, end)  # R b8[T, 4]
v118 = unsqueeze(v117, 1)  # R b8[T, 1, 4]
v119 = bitwise_not(v118)  # R b8[T, 1, 4]
v120 = masked_fill(v116, v119, -inf)  # S(1) f32[T, 2, 4]
v121 = unsqueeze(layers.1.attn.attn_sink, 0)  # S(1) f32[1, 2]
v122 = unsqueeze(v121, 2)  # S(1) f32[1, 2, 1]
v123 = expand(v122, [positions.size()[0], -1, 1])  # S(1) f32[T, 2, 1]
v124 = cat([v120, v123], -1)  # S(1) f32[T, 2, 5]
v125 = _softmax(v124, -1, False)  # S(1) f32[T, 2, 5]
v126 = slice(v125, 2, 0, -1)  # S(1) f32[T, 2, 4]
v127 = unsqueeze(v126, 3)  # S(1) f32[T, 2, 4, 1]
v128 = permute(v127, [0, 1, 3, 2])  # S(1) f32[T, 2, 1, 4]
v129 = unsqueeze(v93, 3)  # R f32[T, 4, 32, 1]
v130 = permute(v129, [0, 3, 2, 1])  # R f32[T, 1, 32, 4]
v131 = permute(v128, [0, 1, 3, 2])  # S(1) f32[T, 2, 4, 1]
v132 = view(v131, [positions.size()[0], 2, 4])  # S(1) f32[T, 2, 4]
v133 = permute(v130, [0, 3, 2, 1])  # R f32[T, 4, 32, 1]
v134 = view(v133, [positions.size()[0], 4, 32])  # R f32[T, 4, 32]
v135 = bmm(v132, v134)  # S(1) f32[T, 2, 32]
v136 = view(v135, [positions.size()[0], 2, 1, 32])  # S(1) f32[T, 2, 1, 32]
v137 = permute(v136, [0, 1, 3, 2])  # S(1) f32[T, 2, 32, 1]
v138 = view(v137, [positions.size()[0], 2, 32])  # S(1) f32[T, 2, 32]
v139 = _to_copy(positions, dtype=f32)  # R f32[T]
v140 = slice(v139, 0, 0, end)  # R f32[T]
v141 = unsqueeze(v140, 1)  # R f32[T, 1]
v142 = unsqueeze(layers.1.attn.rope_inv_freq, 0)  # R f32[1, 4]
v143 = mul(v141, v142)  # R f32[T, 4]
v144 = view(v143, [positions.size()[0], 1, 4])  # R f32[T, 1, 4]
v145 = cos(v144)  # R f32[T, 1, 4]
v146 = sin(v144)  # R f32[T, 1, 4]
v147 = neg(v146)  # R f32[T, 1, 4]
v148 = slice(v138, 2, -8, end)  # S(1) f32[T, 2, 8]
v149 = view(v148, [positions.size()[0], 2, 4, 2])  # S(1) f32[T, 2, 4, 2]
v150 = unbind(v149, -1)  # (S(1), S(1)) (f32[T, 2, 4], f32[T, 2, 4])
v151 = getitem(v150, 0)  # S(1) f32[T, 2, 4]
v152 = getitem(v150, 1)  # S(1) f32[T, 2, 4]
v153 = mul(v151, v145)  # S(1) f32[T, 2, 4]
v154 = mul(v152, v147)  # S(1) f32[T, 2, 4]
v155 = sub(v153, v154)  # S(1) f32[T, 2, 4]
v156 = mul(v151, v147)  # S(1) f32[T, 2, 4]
v157 = mul(v152, v145)  # S(1) f32[T, 2, 4]
v158 = add(v156, v157)  # S(1) f32[T, 2, 4]
v159 = stack([v155, v158], -1)  # S(1) f32[T, 2, 4, 2]
v160 = view(v159, [positions.size()[0], 2, 8])  # S(1) f32[T, 2, 8]
v161 = slice(v138, 2, 0, -8)  # S(1) f32[T, 2, 24]
v162 = cat([v161, v160], -1)  # S(1) f32[T, 2, 32]
v163 = view(layers.1.attn.wo_a.weight, [1, 16, 64])  # S(0) f32[1, 16, 64]
v164 = view(v162, [positions.size()[0], 1, 64])  # S(1) f32[T, 1, 64]
v165 = unsqueeze(v164, 3)  # S(1) f32[T, 1, 64, 1]
v166 = permute(v165, [0, 1, 3, 2])  # S(1) f32[T, 1, 1, 64]
v167 = unsqueeze(v163, 3)  # S(0) f32[1, 16, 64, 1]
v168 = permute(v167, [3, 0, 1, 2])  # S(1) f32[1, 1, 16, 64]
v169 = permute(v166, [1, 0, 3, 2])  # S(0) f32[1, T, 64, 1]
v170 = view(v169, [1, positions.size()[0], 64])  # S(0) f32[1, T, 64]
v171 = permute(v168, [1, 3, 2, 0])  # S(0) f32[1, 64, 16, 1]
v172 = view(v171, [1, 64, 16])  # S(0) f32[1, 64, 16]
v173 = bmm(v170, v172)  # S(0) f32[1, T, 16]
v174 = view(v173, [1, positions.size()[0], 1, 16])  # S(0) f32[1, T, 1, 16]
v175 = permute(v174, [1, 0, 3, 2])  # S(1) f32[T, 1, 16, 1]
v176 = view(v175, [positions.size()[0], 1, 16])  # S(1) f32[T, 1, 16]
v177 = clone(v176, memory_format=torch.contiguous_format)  # S(1) f32[T, 1, 16]
v178 = _unsafe_view(v177, [positions.size()[0], 16])  # S(1) f32[T, 16]
v179 = t(layers.1.attn.wo_b.weight)  # R f32[64, 64]
v180 = constant_pad_nd(v178, [0, 0, 0, in2], 0)  # f32[4*(((T+3)//4)), 16]
v181 = _c10d_functional.all_to_all_single(v180, [in4, in4, in4, in4], [in4, in4, in4, in4], 'tp')  # f32[4*(((T+3)//4)), 16]  <- S(1) -> S(0): v187 in layers.1.attn.wo_b needs v178 as S(0) (dtensor (S(0), R) -> S(0)); attn_exit='auto': all_to_all, 48 B per token against 192 B reduce_scatter; wo_b replicated: +24,576 B of weights per rank
v182 = _c10d_functional.wait_tensor(v181)  # f32[4*(((T+3)//4)), 16]  <- S(1) -> S(0): v187 in layers.1.attn.wo_b needs v178 as S(0) (dtensor (S(0), R) -> S(0)); attn_exit='auto': all_to_all, 48 B per token against 192 B reduce_scatter; wo_b replicated: +24,576 B of weights per rank
v183 = unflatten(v182, 0, [4, in4])  # f32[4, ((T+3)//4), 16]
v184 = permute(v183, [1, 0, 2])  # f32[((T+3)//4), 4, 16]
v185 = clone(v184, memory_format=torch.contiguous_format)  # f32[((T+3)//4), 4, 16]
v186 = view(v185, [-1, 64])  # S(0) f32[((T+3)//4), 64]
v187 = mm(v186, v179)  # S(0) f32[((T+3)//4), 64]""",
        )
