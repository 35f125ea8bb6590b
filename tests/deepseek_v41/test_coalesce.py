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
from dsv41_compile.report.accounting import graph_costs, summarize

# a window-only layer and a ratio-2 layer that is a KV and index source (its compressor's and
# indexer's projections gathered beside the latents)
FLASH_2 = {
    "n_layers": 2,
    "compress_ratios": (0, 2),
    "kv_source_layer_ids": (1,),
    "index_source_layer_ids": (1,),
    "candidate_source_layer_id": -1,
    "engram_layer_ids": (1,),  # flash's first table (its Engram layers are 1 and 14)
    "engram_num_embeddings": (384006168,),
}


@pytest.fixture(scope="module")
def flash():
    cfg = ModelConfig.from_name(
        "flash",
        **FLASH_2,
        **dict(SINKHORN_3),
        weight_format="released",
        numerics="official",
        dtype="bfloat16",
    )
    gm, ctx, _ = plan_rank(
        cfg, {"tp": 4, "ep": 8, "lowering": "eager"}, world_size=8,
        requests=[Request(0, [1], 0)], max_len=256,
    )  # fmt: skip
    return gm, ctx


def test_a_flash_layer_gathers_its_entry_once(flash):
    _, ctx = flash
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


def test_the_engram_exchange_rides_in_the_ep_exchange_before_it(flash):
    """The Engram layer's table (split by column over the world, `engram="auto"` at flash
    sizes) is looked up through an exchange of row ids and rows (`tables`); with the padded EP
    dispatch (`ep_dispatch="auto"` at decode) the ids leave with layer 0's dispatch and the rows
    come back with its combine, side by side per token slot as bytes: no collective of its
    own (layer 1's count is the layout's 4), the same bytes. The 8-rank numerics of a riding
    exchange are tests/distributed/test_front_door.py's sp run; of an exchange on its own
    (the exact dispatch), tests/distributed/test_numerics.py's every-mode run."""
    gm, ctx = flash
    assert not [r for r in ctx.comm if r["reason"].startswith("table rows")]
    ep = [r for r in ctx.comm if r["axis"] == "ep"]
    assert [(r["kind"], r["dtype"], r["layer"]) for r in ep] == [
        ("all_to_all", "uint8", 0),
        ("all_to_all", "uint8", 0),
        ("all_to_all", "uint8", 1),
        ("all_to_all", "bfloat16", 1),
    ], ep
    dispatch, combine = ep[:2]
    # layer 1's dispatch moves per token slot its rows (per_rank: one row of FP8 codes, their
    # scales and 6 routes); layer 0's the same and the 3 int64 row ids of this rank's columns;
    # its combine one bf16 row (as bytes) and the 3 table rows (264 B each)
    row = int(ep[2]["input_shape"][1])
    assert dispatch["input_shape"] == ["8*Tl_max", str(row + 3 * 8)], dispatch
    assert ep[3]["input_shape"] == ["8*Tl_max", "5120"], ep[3]  # D
    assert combine["input_shape"] == ["8*Tl_max", str(2 * 5120 + 3 * 264)], combine
    for record in (dispatch, combine):
        assert "table rows" in record["reason"] and "riding" in record["reason"], record
        assert "engram='auto': sharded" in record["reason"], record["reason"]
    assert dispatch["riding"] == {"own_bytes_per_slot": row, "rider_bytes_per_slot": 3 * 8}
    assert combine["riding"] == {"own_bytes_per_slot": 2 * 5120, "rider_bytes_per_slot": 792}
    # the accounting gives the exchange its share: per token (Tl_max = 1 at T = 4), 7 peers'
    # 3 ids of 8 B out and 3 rows of 264 B back, docs/backend.md's 5,712 B per token and
    # Engram layer; layer 0 carries it, with two all-to-alls
    summary = summarize(graph_costs(gm, ctx), 4)
    assert summary["tables"]["layers"] == [0]
    assert summary["tables"]["bytes_sent_per_table_layer"] == 7 * (3 * 8 + 3 * 264)
    assert summary["collectives"]["all_to_all(ep)"]["count"] == 2


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
