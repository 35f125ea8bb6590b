"""Tier 2: the rewritten per-rank graph on a fake process group (no communication happens)."""

from __future__ import annotations

import json
from collections import Counter

import expecttest
import pytest
import torch
import torch._dynamo

import dsv41_compile
from dsv41_compile.dump import graph_labels
from dsv41_compile.fx_utils import REGION
from dsv41_compile.mesh import clear_mesh_cache
from dsv41_compile.model import DeepseekV41, ModelConfig
from dsv41_compile.testing.batches import Request, pack
from dsv41_compile.testing.capture import capture_programs
from dsv41_compile.testing.graph_printer import format_graph
from dsv41_compile.testing.torch_shims import fake_process_group
from dsv41_compile.validate import collective_kind

REQUESTS = [Request(0, [1, 2, 3], 0), Request(1, [4, 5], 0), Request(2, [6, 7, 8], 0)]


def compile_on_fake_rank(rank: int, options: dict, cfg: ModelConfig | None = None, **kw):
    """Compile tiny-swa on rank `rank` of a fake 8-rank world; returns (gm, ctx, logits)."""
    cfg = cfg or ModelConfig.from_name("tiny-swa")
    torch.manual_seed(0)
    model = DeepseekV41(cfg)
    torch._dynamo.reset()
    with fake_process_group(world_size=8, rank=rank), capture_programs() as programs:
        clear_mesh_cache()
        ids, positions, slots = pack(REQUESTS)
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


def layer_text(gm, ctx, layer: int) -> str:
    labels, groups = graph_labels(ctx)
    return format_graph(gm, labels=labels, groups=groups, region=f"layers.{layer}")


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


class TestLayerSnapshot(expecttest.TestCase):
    def test_layer_1_of_tiny_swa_tp4(self):
        gm, ctx, _ = compile_on_fake_rank(1, {"tp": 4})
        text = "\n".join(
            line
            for line in layer_text(gm, ctx, 1).splitlines()
            if "_c10d_" in line or "index(" in line
        )
        self.assertExpectedInline(
            text,
            """\
all_gather_into_tensor_default_1 = _c10d_functional.all_gather_into_tensor(mul_1438, 4, 'tp')  # f32[4*(((T+3)//4)), 64]  <- S(0) -> R: mm_11 in layers.1.attn needs mul_1438 as R
wait_tensor_default_2 = _c10d_functional.wait_tensor(all_gather_into_tensor_default_1)  # f32[4*(((T+3)//4)), 64]  <- S(0) -> R: mm_11 in layers.1.attn needs mul_1438 as R
index_1 = index(index_put_1, [unsqueeze_37, clamp_3])  # R f32[T, 4, 32]
reduce_scatter_tensor_default_1 = _c10d_functional.reduce_scatter_tensor(constant_pad_nd_default_4, 'sum', 4, 'tp')  # f32[((T+3)//4), 64]  <- P -> S(0): slice_65 in layers.1 needs mm_14 as S(0) (dtensor (S(0)) -> S(0))
wait_tensor_default_3 = _c10d_functional.wait_tensor(reduce_scatter_tensor_default_1)  # S(0) f32[((T+3)//4), 64]  <- P -> S(0): slice_65 in layers.1 needs mm_14 as S(0) (dtensor (S(0)) -> S(0))""",
        )
