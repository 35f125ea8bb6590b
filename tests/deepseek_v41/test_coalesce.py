"""The `coalesce` pass on DeepSeek V4.1: a layer's entry gathers move in one AllGather; and the
step's Engram lookups share one exchange (`tables`).

Flash's sizes are planned on meta tensors (`planning.plan_rank`, rank 0 of a fake world of 8,
tp=4, ep=8, weights as released: the FP8 q latent beside the bf16 kv latent and the
compressors' fp32 projections), cut to two layers. The 8-rank numerics
of a coalesced entry are tests/distributed/test_front_door.py's (tiny-swa at D = 128)."""

from __future__ import annotations

import pytest
import torch
from torch.fx import Graph, GraphModule

from dsv41_compile.core.packing import Column, pack, packed_dtype, unpack
from dsv41_compile.deepseek_v41.model import ModelConfig
from dsv41_compile.deepseek_v41.testing.batches import Request
from dsv41_compile.deepseek_v41.testing.presets import SINKHORN_3
from dsv41_compile.planning import plan_rank

# a window-only layer and a ratio-2 layer that is a KV and index source (its compressor's and
# indexer's projections gathered beside the latents)
FLASH_2 = {
    "n_layers": 2,
    "compress_ratios": (0, 2),
    "kv_source_layer_ids": (1,),
    "index_source_layer_ids": (1,),
    "candidate_source_layer_id": -1,
    "engram_layer_ids": (0, 1),  # flash's two tables (its Engram layers are 1 and 14)
    "engram_num_embeddings": (384006168, 384016682),
}


@pytest.fixture(scope="module")
def flash_ctx():
    cfg = ModelConfig.from_name(
        "flash",
        **FLASH_2,
        **dict(SINKHORN_3),
        weight_format="released",
        numerics="official",
        dtype="bfloat16",
    )
    _, ctx, _ = plan_rank(
        cfg, {"tp": 4, "ep": 8, "lowering": "eager"}, world_size=8,
        requests=[Request(0, [1], 0)], max_len=256,
    )  # fmt: skip
    return ctx


def test_a_flash_layer_gathers_its_entry_once(flash_ctx):
    ctx = flash_ctx
    entry = {}
    for record in ctx.comm:
        at_entry = ctx.adapter.site(record["region"]).part == "attention"
        if record["kind"] == "all_gather" and record["axis"] == "tp" and at_entry:
            entry.setdefault(record["layer"], []).append(record)
    assert sorted(entry) == [0, 1]
    for layer, gathers in entry.items():
        assert len(gathers) == 1, (layer, [g["node"] for g in gathers])
        (gather,) = gathers
        members = gather["members"]
        assert len(members) >= 2, (layer, members)
        # the merged rows are the members' bytes side by side, whatever their dtypes
        widths = [m["columns"] * torch.empty(0, dtype=getattr(torch, m["dtype"])).element_size()
                  for m in members]  # fmt: skip
        assert gather["dtype"] == "uint8" and gather["input_shape"][1] == str(sum(widths))
        assert len({m["dtype"] for m in members}) > 1, members
        assert "entry gathers of layer values as one AllGather" in gather["reason"]


def test_the_engram_layers_share_one_exchange_per_step(flash_ctx):
    """Both Engram layers hash the input ids, so their tables (split by column over the world,
    `engram="auto"` at flash sizes) are looked up in one exchange before the first: one
    all-to-all of both layers' row ids (3 + 3 per rank and token), one of their rows back
    (264 B each), where each layer had its own two. The 8-rank numerics of two Engram layers
    sharing the exchange are tests/distributed/test_numerics.py's every-mode run."""
    table = [r for r in flash_ctx.comm if r["reason"].startswith("table rows")]
    assert [(r["kind"], r["axis"], r["dtype"], r["layer"]) for r in table] == [
        ("all_to_all", "ep", "int64", 0),
        ("all_to_all", "ep", "uint8", 0),
    ], table
    ids, rows = table
    assert ids["input_shape"] == [str(8 * (3 + 3)) + "*Tl_max"], ids
    assert rows["input_shape"] == ["8*Tl_max", str((3 + 3) * 264)], rows
    assert "3 + 3 (the 2 lookups of layers.0.engram.embed, layers.1.engram.embed)" in ids["reason"]
    assert "engram='auto': sharded" in ids["reason"], ids["reason"]  # the choice, not attn_exit's


def test_packed_rows_come_back_bit_for_bit():
    """The rows `core.packing` puts side by side (as bytes: written so that torch's view.dtype
    and GE's Bitcast give the same shapes) come back with every bit: fp32 (a NaN, a negative
    zero, a subnormal), bf16 and FP8 codes in one uint8 tensor."""
    values = [
        torch.tensor([[1.5, float("nan")], [-0.0, 3e-39]]),
        torch.tensor([[0.1, -2.0, 7.0], [1e30, 0.0, -1.0]], dtype=torch.bfloat16),
        torch.tensor([[0.5], [-448.0]]).to(torch.float8_e4m3fn),
    ]
    columns = [Column(v.dtype, (v.shape[1],)) for v in values]
    graph = Graph()

    def call(target, *args):
        return graph.call_function(target, args)

    inputs = [graph.placeholder(f"v{i}") for i in range(len(values))]
    packed = pack(call, inputs, columns)
    graph.output((packed, *unpack(call, packed, columns)))
    rows, *back = GraphModule(torch.nn.Module(), graph)(*values)
    assert packed_dtype(columns) == rows.dtype == torch.uint8
    assert rows.shape == (2, 2 * 4 + 3 * 2 + 1)
    for before, after in zip(values, back, strict=True):
        assert after.dtype == before.dtype and after.shape == before.shape
        assert torch.equal(after.view(torch.uint8), before.view(torch.uint8))
