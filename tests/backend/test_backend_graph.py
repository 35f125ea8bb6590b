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
from dsv41_compile.dump import graph_labels
from dsv41_compile.fx_utils import REASON, REGION
from dsv41_compile.mesh import clear_mesh_cache
from dsv41_compile.model import DeepseekV41, ModelConfig
from dsv41_compile.testing.batches import Request, pack
from dsv41_compile.testing.capture import capture_programs
from dsv41_compile.testing.graph_printer import format_graph
from dsv41_compile.testing.torch_shims import fake_process_group
from dsv41_compile.validate import collective_kind

REQUESTS = [Request(0, [1, 2, 3], 0), Request(1, [4, 5], 0), Request(2, [6, 7, 8], 0)]


def compile_on_fake_rank(
    rank: int, options: dict, cfg: ModelConfig | None = None, requests=None, **kw
):
    """Compile tiny-swa on rank `rank` of a fake 8-rank world and run it once on `requests`
    (default: 3, 2 and 3 tokens); returns (gm, ctx, logits)."""
    cfg = cfg or ModelConfig.from_name("tiny-swa")
    torch.manual_seed(0)
    model = DeepseekV41(cfg)
    torch._dynamo.reset()
    with fake_process_group(world_size=8, rank=rank), capture_programs() as programs:
        clear_mesh_cache()
        ids, positions, slots = pack(REQUESTS if requests is None else requests)
        dsv41_compile.mark_token_dim(ids, positions, slots)
        compiled = torch.compile(
            model, backend="dsv41_sp", options={"lowering": "eager", **options}, fullgraph=True
        )
        logits = compiled(ids, positions, slots, model.new_cache(4, 32), **kw)
    clear_mesh_cache()
    (gm, ctx), *_ = programs
    return gm, ctx, logits


@pytest.fixture(scope="module")
def rank1():
    return compile_on_fake_rank(1, {"tp": 4})


def layer_text(gm, ctx, layer: int, block: str = "") -> str:
    labels, groups = graph_labels(ctx)
    return format_graph(gm, labels=labels, groups=groups, region=f"layers.{layer}{block}")


def collectives(gm) -> list:
    return [n for n in gm.graph.nodes if collective_kind(n)]


def test_one_all_gather_of_the_2d_attention_input_and_one_fp32_reduce_scatter_per_layer(rank1):
    gm, ctx, logits = rank1
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


def test_graph_text_is_identical_on_every_rank(rank1):
    gm1, ctx1, _ = rank1
    text1 = format_graph(gm1, labels=graph_labels(ctx1)[0], groups=graph_labels(ctx1)[1])
    for rank in (0, 6):  # another tp_rank of the same DP group, and the other DP group
        gm, ctx, _ = compile_on_fake_rank(rank, {"tp": 4})
        labels, groups = graph_labels(ctx)
        assert format_graph(gm, labels=labels, groups=groups) == text1


def test_vocab_sharded_embedding_enters_with_one_reduce_scatter():
    gm, _, _ = compile_on_fake_rank(2, {"tp": 4, "embedding": "vocab_sharded"})
    first, *rest = collectives(gm)
    assert collective_kind(first) == "reduce_scatter"
    partials = first.args[0].meta["val"]
    assert partials.dim() == 2 and partials.shape[1] == 64  # [T, D], not the [T, 4, D] streams
    assert partials.dtype == torch.float32
    assert [collective_kind(n) for n in rest] == ["all_gather", "reduce_scatter"] * 2 + [
        "all_gather"
    ]


def test_dump_writes_graph_and_comm_records(tmp_path):
    compile_on_fake_rank(5, {"tp": 4, "dump_dir": str(tmp_path)})
    graph = (tmp_path / "rank5" / "graph.py").read_text()
    assert "_c10d_functional.all_gather_into_tensor(" in graph and "<- S(0) -> R" in graph
    comm = json.loads((tmp_path / "rank5" / "comm.json").read_text())
    assert (comm["rank"], comm["tp_rank"], comm["dp_rank"]) == (5, 1, 1)
    kinds = [c["kind"] for c in comm["collectives"]]
    assert kinds == ["all_gather", "reduce_scatter"] * 2 + ["all_gather"]
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


def test_bf16_rounding_boundaries_are_the_single_device_ones():
    cfg = ModelConfig.from_name("tiny-swa", dtype="bfloat16")
    gm, _, _ = compile_on_fake_rank(3, {"tp": 4}, cfg=cfg)
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
    scatters = [n for n in collectives(gm) if collective_kind(n) == "reduce_scatter"]
    assert [n.args[0].meta["val"].dtype for n in scatters] == [torch.float32] * 2
    gathers = [n for n in collectives(gm) if collective_kind(n) == "all_gather"]
    assert [n.args[0].meta["val"].dtype for n in gathers] == [torch.bfloat16] * 3


def test_one_compile_serves_every_token_count():
    torch.manual_seed(0)
    model = DeepseekV41(ModelConfig.from_name("tiny-swa"))
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
            layer_text(gm, ctx, 1, ".attn"),
            """\
t_11 = t(layers.1.attn.wq_a.weight)  # R f32[64, 32]
all_gather_into_tensor_default_1 = _c10d_functional.all_gather_into_tensor(mul_1438, 4, 'tp')  # f32[4*(((T+3)//4)), 64]  <- S(0) -> R: mm_11 in layers.1.attn needs mul_1438 as R
wait_tensor_default_2 = _c10d_functional.wait_tensor(all_gather_into_tensor_default_1)  # f32[4*(((T+3)//4)), 64]  <- S(0) -> R: mm_11 in layers.1.attn needs mul_1438 as R
split_with_sizes_default_1 = split_with_sizes(wait_tensor_default_2, [sym_size_int_46, sub_1052])  # (f32[T, 64], f32[-T+4*(((T+3)//4)), 64])
getitem_17 = getitem(split_with_sizes_default_1, 0)  # R f32[T, 64]
mm_11 = mm(getitem_17, t_11)  # R f32[T, 32]
pow_9 = pow(mm_11, 2)  # R f32[T, 32]
mean_8 = mean(pow_9, [-1], True)  # R f32[T, 1]
add_2674 = add(mean_8, 1e-06)  # R f32[T, 1]
rsqrt_8 = rsqrt(add_2674)  # R f32[T, 1]
mul_1448 = mul(mm_11, rsqrt_8)  # R f32[T, 32]
mul_1451 = mul(layers.1.attn.q_norm.weight, mul_1448)  # R f32[T, 32]
t_12 = t(layers.1.attn.wq_b.weight)  # S(1) f32[32, 64]
mm_12 = mm(mul_1451, t_12)  # S(1) f32[T, 64]
view_37 = view(mm_12, [positions.size()[0], -1, 32])  # S(1) f32[T, 2, 32]
_to_copy_5 = _to_copy(positions, dtype=f32)  # R f32[T]
slice_51 = slice(_to_copy_5, 0, 0, end)  # R f32[T]
unsqueeze_32 = unsqueeze(slice_51, 1)  # R f32[T, 1]
unsqueeze_33 = unsqueeze(layers.1.attn.rope_inv_freq, 0)  # R f32[1, 4]
mul_1461 = mul(unsqueeze_32, unsqueeze_33)  # R f32[T, 4]
view_38 = view(mul_1461, [positions.size()[0], 1, 4])  # R f32[T, 1, 4]
cos_3 = cos(view_38)  # R f32[T, 1, 4]
sin_3 = sin(view_38)  # R f32[T, 1, 4]
slice_52 = slice(view_37, 2, -8, end)  # S(1) f32[T, 2, 8]
view_39 = view(slice_52, [positions.size()[0], -1, 4, 2])  # S(1) f32[T, 2, 4, 2]
unbind_3 = unbind(view_39, -1)  # (S(1), S(1)) (f32[T, 2, 4], f32[T, 2, 4])
getitem_8 = getitem(unbind_3, 0)  # S(1) f32[T, 2, 4]
getitem_9 = getitem(unbind_3, 1)  # S(1) f32[T, 2, 4]
mul_1478 = mul(getitem_8, cos_3)  # S(1) f32[T, 2, 4]
mul_1481 = mul(getitem_9, sin_3)  # S(1) f32[T, 2, 4]
sub_698 = sub(mul_1478, mul_1481)  # S(1) f32[T, 2, 4]
mul_1486 = mul(getitem_8, sin_3)  # S(1) f32[T, 2, 4]
mul_1489 = mul(getitem_9, cos_3)  # S(1) f32[T, 2, 4]
add_2753 = add(mul_1486, mul_1489)  # S(1) f32[T, 2, 4]
stack_3 = stack([sub_698, add_2753], -1)  # S(1) f32[T, 2, 4, 2]
view_40 = view(stack_3, [positions.size()[0], -1, 8])  # S(1) f32[T, 2, 8]
slice_53 = slice(view_37, 2, 0, -8)  # S(1) f32[T, 2, 24]
cat_4 = cat([slice_53, view_40], -1)  # S(1) f32[T, 2, 32]
t_13 = t(layers.1.attn.wkv.weight)  # R f32[64, 32]
mm_13 = mm(getitem_17, t_13)  # R f32[T, 32]
pow_10 = pow(mm_13, 2)  # R f32[T, 32]
mean_9 = mean(pow_10, [-1], True)  # R f32[T, 1]
add_2784 = add(mean_9, 1e-06)  # R f32[T, 1]
rsqrt_9 = rsqrt(add_2784)  # R f32[T, 1]
mul_1514 = mul(mm_13, rsqrt_9)  # R f32[T, 32]
mul_1517 = mul(layers.1.attn.kv_norm.weight, mul_1514)  # R f32[T, 32]
_to_copy_6 = _to_copy(positions, dtype=f32)  # R f32[T]
slice_54 = slice(_to_copy_6, 0, 0, end)  # R f32[T]
unsqueeze_34 = unsqueeze(slice_54, 1)  # R f32[T, 1]
unsqueeze_35 = unsqueeze(layers.1.attn.rope_inv_freq, 0)  # R f32[1, 4]
mul_1523 = mul(unsqueeze_34, unsqueeze_35)  # R f32[T, 4]
view_41 = view(mul_1523, [positions.size()[0], 4])  # R f32[T, 4]
cos_4 = cos(view_41)  # R f32[T, 4]
sin_4 = sin(view_41)  # R f32[T, 4]
slice_55 = slice(mul_1517, 1, -8, end)  # R f32[T, 8]
view_42 = view(slice_55, [positions.size()[0], 4, 2])  # R f32[T, 4, 2]
unbind_4 = unbind(view_42, -1)  # (R, R) (f32[T, 4], f32[T, 4])
getitem_10 = getitem(unbind_4, 0)  # R f32[T, 4]
getitem_11 = getitem(unbind_4, 1)  # R f32[T, 4]
mul_1540 = mul(getitem_10, cos_4)  # R f32[T, 4]
mul_1543 = mul(getitem_11, sin_4)  # R f32[T, 4]
sub_727 = sub(mul_1540, mul_1543)  # R f32[T, 4]
mul_1548 = mul(getitem_10, sin_4)  # R f32[T, 4]
mul_1551 = mul(getitem_11, cos_4)  # R f32[T, 4]
add_2844 = add(mul_1548, mul_1551)  # R f32[T, 4]
stack_4 = stack([sub_727, add_2844], -1)  # R f32[T, 4, 2]
view_43 = view(stack_4, [positions.size()[0], 8])  # R f32[T, 8]
slice_56 = slice(mul_1517, 1, 0, -8)  # R f32[T, 24]
cat_5 = cat([slice_56, view_43], -1)  # R f32[T, 32]
index_put_1 = index_put(cache.window_kv[1], [where, positions], cat_5)  # R f32[5, 32, 32]
slice_57 = slice(positions, 0, 0, end)  # R i64[T]
unsqueeze_36 = unsqueeze(slice_57, 1)  # R i64[T, 1]
sub_741 = sub(unsqueeze_36, 3)  # R i64[T, 1]
arange_2 = arange(4, pin_memory=False)  # R i64[4]
add_2876 = add(sub_741, arange_2)  # R i64[T, 4]
slice_58 = slice(where, 0, 0, end)  # R i64[T]
unsqueeze_37 = unsqueeze(slice_58, 1)  # R i64[T, 1]
clamp_3 = clamp(add_2876, 0)  # R i64[T, 4]
index_1 = index(index_put_1, [unsqueeze_37, clamp_3])  # R f32[T, 4, 32]
ge_12 = ge(add_2876, 0)  # R b8[T, 4]
unsqueeze_38 = unsqueeze(cat_4, 3)  # S(1) f32[T, 2, 32, 1]
permute_25 = permute(unsqueeze_38, [0, 1, 3, 2])  # S(1) f32[T, 2, 1, 32]
unsqueeze_39 = unsqueeze(index_1, 3)  # R f32[T, 4, 32, 1]
permute_26 = permute(unsqueeze_39, [0, 3, 1, 2])  # R f32[T, 1, 4, 32]
permute_27 = permute(permute_25, [0, 1, 3, 2])  # S(1) f32[T, 2, 32, 1]
view_44 = view(permute_27, [positions.size()[0], -1, 32])  # S(1) f32[T, 2, 32]
permute_28 = permute(permute_26, [0, 3, 2, 1])  # R f32[T, 32, 4, 1]
view_45 = view(permute_28, [positions.size()[0], 32, 4])  # R f32[T, 32, 4]
bmm_5 = bmm(view_44, view_45)  # S(1) f32[T, 2, 4]
view_46 = view(bmm_5, [positions.size()[0], -1, 1, 4])  # S(1) f32[T, 2, 1, 4]
permute_29 = permute(view_46, [0, 1, 3, 2])  # S(1) f32[T, 2, 4, 1]
view_47 = view(permute_29, [positions.size()[0], -1, 4])  # S(1) f32[T, 2, 4]
mul_1619 = mul(view_47, 0.1767766952966369)  # S(1) f32[T, 2, 4]
slice_59 = slice(ge_12, 0, 0, end)  # R b8[T, 4]
unsqueeze_40 = unsqueeze(slice_59, 1)  # R b8[T, 1, 4]
bitwise_not_1 = bitwise_not(unsqueeze_40)  # R b8[T, 1, 4]
masked_fill_1 = masked_fill(mul_1619, bitwise_not_1, -inf)  # S(1) f32[T, 2, 4]
unsqueeze_41 = unsqueeze(layers.1.attn.attn_sink, 0)  # S(1) f32[1, 2]
unsqueeze_42 = unsqueeze(unsqueeze_41, 2)  # S(1) f32[1, 2, 1]
expand_2 = expand(unsqueeze_42, [positions.size()[0], -1, 1])  # S(1) f32[T, 2, 1]
cat_6 = cat([masked_fill_1, expand_2], -1)  # S(1) f32[T, 2, 5]
_softmax_4 = _softmax(cat_6, -1, False)  # S(1) f32[T, 2, 5]
slice_60 = slice(_softmax_4, 2, 0, -1)  # S(1) f32[T, 2, 4]
unsqueeze_43 = unsqueeze(slice_60, 3)  # S(1) f32[T, 2, 4, 1]
permute_30 = permute(unsqueeze_43, [0, 1, 3, 2])  # S(1) f32[T, 2, 1, 4]
unsqueeze_44 = unsqueeze(index_1, 3)  # R f32[T, 4, 32, 1]
permute_31 = permute(unsqueeze_44, [0, 3, 2, 1])  # R f32[T, 1, 32, 4]
permute_32 = permute(permute_30, [0, 1, 3, 2])  # S(1) f32[T, 2, 4, 1]
view_48 = view(permute_32, [positions.size()[0], -1, 4])  # S(1) f32[T, 2, 4]
permute_33 = permute(permute_31, [0, 3, 2, 1])  # R f32[T, 4, 32, 1]
view_49 = view(permute_33, [positions.size()[0], 4, 32])  # R f32[T, 4, 32]
bmm_6 = bmm(view_48, view_49)  # S(1) f32[T, 2, 32]
view_50 = view(bmm_6, [positions.size()[0], -1, 1, 32])  # S(1) f32[T, 2, 1, 32]
permute_34 = permute(view_50, [0, 1, 3, 2])  # S(1) f32[T, 2, 32, 1]
view_51 = view(permute_34, [positions.size()[0], -1, 32])  # S(1) f32[T, 2, 32]
_to_copy_7 = _to_copy(positions, dtype=f32)  # R f32[T]
slice_61 = slice(_to_copy_7, 0, 0, end)  # R f32[T]
unsqueeze_45 = unsqueeze(slice_61, 1)  # R f32[T, 1]
unsqueeze_46 = unsqueeze(layers.1.attn.rope_inv_freq, 0)  # R f32[1, 4]
mul_1674 = mul(unsqueeze_45, unsqueeze_46)  # R f32[T, 4]
view_52 = view(mul_1674, [positions.size()[0], 1, 4])  # R f32[T, 1, 4]
cos_5 = cos(view_52)  # R f32[T, 1, 4]
sin_5 = sin(view_52)  # R f32[T, 1, 4]
neg_1 = neg(sin_5)  # R f32[T, 1, 4]
slice_62 = slice(view_51, 2, -8, end)  # S(1) f32[T, 2, 8]
view_53 = view(slice_62, [positions.size()[0], -1, 4, 2])  # S(1) f32[T, 2, 4, 2]
unbind_5 = unbind(view_53, -1)  # (S(1), S(1)) (f32[T, 2, 4], f32[T, 2, 4])
getitem_12 = getitem(unbind_5, 0)  # S(1) f32[T, 2, 4]
getitem_13 = getitem(unbind_5, 1)  # S(1) f32[T, 2, 4]
mul_1693 = mul(getitem_12, cos_5)  # S(1) f32[T, 2, 4]
mul_1696 = mul(getitem_13, neg_1)  # S(1) f32[T, 2, 4]
sub_796 = sub(mul_1693, mul_1696)  # S(1) f32[T, 2, 4]
mul_1701 = mul(getitem_12, neg_1)  # S(1) f32[T, 2, 4]
mul_1704 = mul(getitem_13, cos_5)  # S(1) f32[T, 2, 4]
add_3101 = add(mul_1701, mul_1704)  # S(1) f32[T, 2, 4]
stack_5 = stack([sub_796, add_3101], -1)  # S(1) f32[T, 2, 4, 2]
view_54 = view(stack_5, [positions.size()[0], -1, 8])  # S(1) f32[T, 2, 8]
slice_63 = slice(view_51, 2, 0, -8)  # S(1) f32[T, 2, 24]
cat_7 = cat([slice_63, view_54], -1)  # S(1) f32[T, 2, 32]
view_55 = view(layers.1.attn.wo_a.weight, [1, 16, -1])  # S(0) f32[1, 16, 64]
view_56 = view(cat_7, [positions.size()[0], 1, -1])  # S(1) f32[T, 1, 64]
unsqueeze_47 = unsqueeze(view_56, 3)  # S(1) f32[T, 1, 64, 1]
permute_35 = permute(unsqueeze_47, [0, 1, 3, 2])  # S(1) f32[T, 1, 1, 64]
unsqueeze_48 = unsqueeze(view_55, 3)  # S(0) f32[1, 16, 64, 1]
permute_36 = permute(unsqueeze_48, [3, 0, 1, 2])  # S(1) f32[1, 1, 16, 64]
permute_37 = permute(permute_35, [1, 0, 3, 2])  # S(0) f32[1, T, 64, 1]
view_57 = view(permute_37, [-1, positions.size()[0], 64])  # S(0) f32[1, T, 64]
permute_38 = permute(permute_36, [1, 3, 2, 0])  # S(0) f32[1, 64, 16, 1]
view_58 = view(permute_38, [-1, 64, 16])  # S(0) f32[1, 64, 16]
bmm_7 = bmm(view_57, view_58)  # S(0) f32[1, T, 16]
view_59 = view(bmm_7, [-1, positions.size()[0], 1, 16])  # S(0) f32[1, T, 1, 16]
permute_39 = permute(view_59, [1, 0, 3, 2])  # S(1) f32[T, 1, 16, 1]
view_60 = view(permute_39, [positions.size()[0], -1, 16])  # S(1) f32[T, 1, 16]
clone_2 = clone(view_60, memory_format=torch.contiguous_format)  # S(1) f32[T, 1, 16]
_unsafe_view_2 = _unsafe_view(clone_2, [positions.size()[0], -1])  # S(1) f32[T, 16]
t_14 = t(layers.1.attn.wo_b.weight)  # S(0) f32[16, 64]
mm_14 = mm(_unsafe_view_2, t_14)  # P f32[T, 64]""",
        )
