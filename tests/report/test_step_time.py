"""The step-time model (`report.step_time`) against hand-computed cases: a matmul, fused
elementwise ops and a collective of the toy family's program (tp=2), then one layer of tiny-swa
(tp=4, ep=8) and its floors against a calculation from the model alone; and that layer as
released, as the npugraph_ex lowering hands it over (torch_npu's ops)."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import sympy
import torch

from dsv41_compile.core.symbols import T
from dsv41_compile.core.torch_private import FloorDiv
from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig
from dsv41_compile.deepseek_v41.testing.presets import AS_RELEASED, ONE_LAYER, SINKHORN_3
from dsv41_compile.devices import DEVICES, Device, device_named
from dsv41_compile.planning import plan_rank
from dsv41_compile.report.step_time import EpLoad, Scenario, step_costs, step_time
from dsv41_compile.targets.npu_dtypes import E2M1
from dsv41_compile.testing.torchair_standin import register_npu_ops
from dsv41_compile.testing.toy import ToyConfig, toy_family

# A device of round numbers: 1 GB/s of memory, 1 GFLOP/s, 1 GB/s of link, 10 us per collective.
SLOW = Device(
    name="slow",
    hbm_bytes=1e9,
    hbm_bytes_per_s=1e9,
    flops={"bf16": 1e9},
    link_bytes_per_s=1e9,
    node_link_bytes_per_s=1e9,
    collective_latency=10e-6,
)


@pytest.fixture(scope="module")
def toy():
    with toy_family():
        gm, ctx, _ = plan_rank(ToyConfig(n_layers=1), {"tp": 2}, world_size=2)
    costs = step_costs(gm, ctx)
    return {op.node: op for op in costs.ops}, costs


def test_a_matmul_reads_its_rows_and_its_weight_once(toy):
    ops, _ = toy
    # the MLP's up projection, column-parallel: x [T, 16] fp32 (the gathered rows) @ its
    # half of up [16 of 32, 16] fp32
    up = ops["mm"]
    assert up.kind == "matmul"
    assert up.read == 16 * 4 * T + 16 * 16 * 4
    assert up.weight_bytes == 16 * 16 * 4
    assert up.written == 16 * 4 * T
    assert up.flops == 2 * T * 16 * 16


def test_pointwise_ops_fuse_into_one_kernel(toy):
    ops, _ = toy
    tl = FloorDiv(T + 1, 2)  # the rank's token shard
    # rms norm: x^2 (read x, write for the mean) ; mean ; + eps, rsqrt, x * r, * weight: one
    # kernel that reads x, the mean and the weight and writes the normed rows
    assert ops["pow_1"].written == 16 * 4 * tl  # read by the mean, a reduction
    assert ops["add_12"].read == 4 * tl and ops["add_12"].written == 0
    assert ops["rsqrt"].read == 0 and ops["rsqrt"].written == 0
    assert ops["mul_8"].read == 16 * 4 * tl and ops["mul_8"].written == 0
    assert ops["mul_11"].read == 16 * 4  # the norm's weight; x * r came from mul_8
    assert ops["mul_11"].written == 16 * 4 * tl  # read by the all-gather
    # relu between two matmuls reads one's output and writes the other's input
    assert ops["relu"].read == ops["relu"].written == 16 * 4 * T


def test_a_collective_is_its_latency_plus_its_bytes_over_the_link(toy):
    ops, costs = toy
    gather = ops["all_gather_into_tensor_default"]
    assert gather.kind == "all_gather(tp)"
    tl = FloorDiv(T + 1, 2)
    assert sympy.simplify(gather.wire - 16 * 4 * tl) == 0  # one peer's shard in, ours out
    times = dict((op.node, s) for s, op in step_time(costs, SLOW, Scenario("t8", 8, 8)).ops)
    assert times["all_gather_into_tensor_default"] == pytest.approx(10e-6 + 256 / 1e9)
    # the matmul at T = 8: 2048 bytes (2.048 us) against 4096 FLOPs (4.096 us): compute-bound
    assert times["mm"] == pytest.approx(4.096e-6)
    assert times["relu"] == pytest.approx(1024 / 1e9)


def test_the_step_is_the_sum_of_its_ops(toy):
    _, costs = toy
    predicted = step_time(costs, SLOW, Scenario("t8", 8, 8))
    assert predicted.seconds == pytest.approx(sum(s for s, _ in predicted.ops))
    assert predicted.collectives == 3  # the MLP's gather and reduce-scatter, the head's gather
    assert predicted.collective_seconds == pytest.approx(
        3 * 10e-6 + sum(float(op.wire.subs(T, 8)) for _, op in predicted.ops) / 1e9
    )
    # a slower collective adds its latency to each
    slower = step_time(costs, SLOW.with_latency(30e-6), Scenario("t8", 8, 8))
    assert slower.seconds - predicted.seconds == pytest.approx(3 * 20e-6)


@pytest.fixture(scope="module")
def tiny(plan_once):
    cfg = ModelConfig.from_name("tiny-swa", n_layers=1)
    gm, ctx = plan_once(cfg, {"tp": 4, "ep": 8}, world_size=8)[:2]
    return cfg, step_costs(gm, ctx)


def test_one_layer_of_tiny_costs_what_its_weights_and_rows_say(tiny):
    cfg, costs = tiny
    assert costs.layers == 1
    assert costs.experts == cfg.n_routed_experts and costs.top_k == cfg.n_activated_experts
    kinds = [op.kind for op in costs.ops if op.layer == 0]
    # the layout's collectives: the attention's entry and exit, the EP exchange
    assert kinds.count("all_gather(tp)") >= 1 and "all_to_all(ep)" in kinds
    predicted = step_time(costs, DEVICES["950dt"], Scenario("decode", 1, 1))
    assert predicted.seconds >= predicted.layout_floor >= predicted.physical_floor > 0
    # per layer: the layer and what is outside the layers add up to the step and its floors
    assert set(predicted.layers) == {None, 0}
    parts = predicted.layers.values()
    assert sum(p.seconds for p in parts) == pytest.approx(predicted.seconds)
    assert sum(p.layout_floor for p in parts) == pytest.approx(predicted.layout_floor)
    assert sum(p.compute_floor for p in parts) == pytest.approx(predicted.compute_floor)
    layer = predicted.layers[0]
    assert layer.seconds >= max(layer.layout_floor, layer.compute_floor) > 0
    # at one row, the routed experts touch K of E: the held experts' bytes at that fraction
    (experts,) = [op for op in costs.ops if op.kind == "experts"]
    assert costs.touched(1) == pytest.approx(cfg.n_activated_experts / cfg.n_routed_experts)
    per_expert = 3 * cfg.moe_inter_dim * cfg.dim * cfg.torch_dtype.itemsize
    assert experts.expert_bytes == per_expert * cfg.n_routed_experts // 8


def test_an_ep_layer_costs_what_its_busiest_rank_does(tiny):
    """A hand-made routing of 64 rows in which every row picks both experts of rank 0 and one
    expert of each of ranks 1 to 4: rank 0 reads both its experts and computes 128
    assignments, ranks 1 to 4 one expert and 64, ranks 5 to 7 nothing. The EP layer's cost is
    rank 0's -- its touched experts' bytes, its assignments' FLOPs -- not the mean rank's;
    uniform routing takes the expected busiest."""
    cfg, costs = tiny
    E, K, ep = cfg.n_routed_experts, cfg.n_activated_experts, 8
    routing = [[0, 1, 2, 4, 6, 8] for _ in range(64)]
    assert K == 6 and E // ep == 2
    loads = EpLoad.of_routing(routing, E, ep)
    assert (loads[0].touched, loads[0].assignments) == (2, 128)
    assert all(load.assignments < 128 for load in loads[1:])
    mean = EpLoad(2, sum(x.touched for x in loads) / ep, sum(x.assignments for x in loads) / ep)
    device = DEVICES["950dt"]
    (op,) = [op for op in costs.ops if op.kind == "experts"]

    def experts_seconds(load):
        timed = step_time(costs, device, Scenario("routed", 16, 64, ep_load=load))
        return next(t for t, o in timed.ops if o is op)

    by_hand = max(
        (float(op.read.subs(T, 16)) + float(op.written.subs(T, 16))
         + float(op.expert_bytes) * loads[0].fraction) / device.hbm_bytes_per_s,
        float(op.assignment_flops) * 128 / device.matmul_flops(op.operand),
    )  # fmt: skip
    assert experts_seconds(loads[0]) == pytest.approx(by_hand)
    assert experts_seconds(loads[0]) > experts_seconds(mean)
    # uniform routing: the expected maximum over the ranks, above the mean and below all
    uniform = costs.busiest(64, 16)
    assert 64 * K / ep < uniform.assignments < 64 * K
    assert costs.touched(64) * 2 <= uniform.touched <= 2


def test_the_requests_that_fit_beside_the_weights_a_rank_holds(tiny):
    """One request's cache on a rank of tiny-swa at tp=4 is one slot of the single-device
    model's cache (its one KV head's window ring, replicated over the TP group); the weights a
    rank holds are the model's with the routed experts split over 8 ranks and the tp-sharded
    ones over 4, so fewer than the whole model's and more than an eighth of them; the requests
    that fit are what is left of the device's memory, in whole caches."""
    cfg, costs = tiny
    with torch.device("meta"):
        model = DeepseekV41(cfg)
    slot = sum(
        t.numel() * t.element_size() / t.shape[0]
        for t in model.new_cache(4, 64).tensors()
        if t.dim() >= 2
    )
    assert costs.cache_bytes_per_request == pytest.approx(slot)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    assert whole / 8 < costs.held_weight_bytes < whole
    # by tensor held: the routed experts a shard of 8 parts, the embedding whole
    assert sum(costs.held_weights.values()) == costs.held_weight_bytes
    assert "layers.0.ffn.experts.w1[0/8]" in costs.held_weights
    assert "embed.weight" in costs.held_weights
    hbm = costs.held_weight_bytes + 10.5 * costs.cache_bytes_per_request
    assert costs.requests_that_fit(hbm) == 10
    assert costs.requests_that_fit(costs.held_weight_bytes / 2) == 0


def test_the_physical_floor_is_the_models_weights_read_once_across_the_world(tiny):
    """From the model alone: every weight and buffer the step reads, once over the 8 ranks (the
    routed experts at the touched fraction; the embedding's rows, not its table), plus the cache
    the rank reads, once per TP group."""
    cfg, costs = tiny
    with torch.device("meta"):
        model = DeepseekV41(cfg)
    touched = 1 - (1 - cfg.n_activated_experts / cfg.n_routed_experts) ** 96
    dense = experts = 0
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        size = p.numel() * p.element_size()
        if name == "embed.weight" or name.startswith("mtp."):
            continue
        if ".ffn.experts." in name or name.endswith(("ffn.w1", "ffn.w2", "ffn.w3")):
            experts += size
        else:
            dense += size
    assert costs.global_expert_bytes == experts
    predicted = step_time(costs, DEVICES["950dt"], Scenario("verify", 48, 96))
    cache = sum(float(op.cache_bytes.subs(T, 48)) for op in costs.ops)
    gathered = sum(float(op.weight_bytes.subs(T, 48)) for op in costs.ops if op.kind == "gather")
    expected = (dense + experts * touched) / 8 + cache / 4 + gathered
    assert predicted.physical_floor * 4e12 == pytest.approx(expected, rel=1e-9)


def test_collectives_across_nodes_take_the_link_between_nodes(tiny):
    """Nodes of 4 ranks (tp=4 within one, ep=8 across two), the link between nodes 10x slower:
    a TP collective takes the node's link; an EP all-to-all sends 4 of its 7 peers' shares
    over the slower link, the other 3 over the node's, at once; a ring collective over nodes
    moves all of its bytes at the slower link's rate."""
    _, costs = tiny
    nodes = Device(
        name="nodes", hbm_bytes=1e9, hbm_bytes_per_s=1e9, flops={"bf16": 1e9},
        link_bytes_per_s=1e9, node_link_bytes_per_s=1e8, ranks_per_node=4,
        collective_latency=10e-6,
    )  # fmt: skip
    scenario = Scenario("t8", 8, 16)
    times = {op.node: (s, op) for s, op in step_time(costs, nodes, scenario).ops}
    kinds = {op.kind for _, op in times.values() if op.collective}
    assert kinds == {"all_gather(tp)", "all_to_all(ep)", "reduce_scatter(tp)"}
    for seconds, op in times.values():
        if not op.collective:
            continue
        wire = float(op.wire.subs(T, 8))
        if op.kind.endswith("(tp)"):
            assert op.group == 4 and seconds == pytest.approx(10e-6 + wire / 1e9)
        else:
            assert op.group == 8
            assert seconds == pytest.approx(10e-6 + max(wire * 4 / 7 / 1e8, wire * 3 / 7 / 1e9))
    assert nodes.collective_seconds(1e3, group=8) == pytest.approx(10e-6 + 1e3 / 1e8)
    assert nodes.collective_seconds(1e3, group=8, all_to_all=True) == pytest.approx(
        10e-6 + 1e3 * 4 / 7 / 1e8
    )
    with pytest.raises(ValueError, match="ranks_per_node must be >= 1"):
        dataclasses.replace(nodes, ranks_per_node=0)


def test_a_device_of_ones_own_and_the_errors_that_name_the_fix():
    assert device_named("950dt") is DEVICES["950dt"]
    with pytest.raises(ValueError, match=r"device='b200' is not a known device; choose one of"):
        device_named("b200")
    with pytest.raises(ValueError, match="flops needs a 'bf16' rate"):
        Device(name="x", hbm_bytes=1, hbm_bytes_per_s=1, flops={}, link_bytes_per_s=1,
               node_link_bytes_per_s=1)  # fmt: skip
    # a dtype the device lacks runs at the next wider rate it has
    assert DEVICES["a3"].matmul_flops("fp4") == DEVICES["a3"].flops["bf16"]
    assert DEVICES["h200"].matmul_flops("fp4") == DEVICES["h200"].flops["fp8"]
    assert math.isclose(DEVICES["950dt"].matmul_flops("fp4"), 2e15)


_UNITS = {"GB": 1e9, "TB/s": 1e12, "GB/s": 1e9, "PFLOP/s": 1e15, "TFLOP/s": 1e12, "": 1}
_COLUMNS = (
    "hbm_bytes", "hbm_bytes_per_s", "bf16", "fp8", "fp4", "link_bytes_per_s",
    "node_link_bytes_per_s", "ranks_per_node",
)  # fmt: skip


def test_every_named_device_is_the_figures_docs_devices_md_gives():
    """Each row of docs/devices.md's table against `DEVICES`: the page is where a figure's
    source is given, so the two must say the same (a rate once read 376 GFLOP/s for the
    table's 376 TFLOP/s)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "devices.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert {re.match(r"\| `([^`]+)`", row)[1] for row in rows} == set(DEVICES)
    for row in rows:
        name, *cells = [c.strip() for c in row.strip("|").split("|")]
        device = DEVICES[name.split("`")[1]]
        for column, cell in zip(_COLUMNS, cells, strict=True):
            figure = re.match(r"(-|[\d.]+) ?([A-Za-z/]*)", cell)
            assert figure is not None, (name, column, cell)
            if column in ("bf16", "fp8", "fp4"):
                want = device.flops.get(column)
            else:
                want = getattr(device, column)
            got = None if figure[1] == "-" else float(figure[1]) * _UNITS[figure[2]]
            assert got == pytest.approx(want), (name, column, cell, want)


def test_the_tools_scenarios_spread_the_requests_over_the_dp_groups(load_tool):
    tool = load_tool("step_time")
    assert [(s.name, s.rows, s.world_rows) for s in tool.scenarios(2)] == [
        ("decode-1", 1, 1),
        ("verify-6", 6, 6),
        ("verify-16x6", 48, 96),
        ("prefill-2x2048", 2048, 4096),
    ]
    # a DSpark model's drafter in each verify step: its block of 5 rows per request
    assert [(s.name, s.rows, s.world_rows) for s in tool.drafter_scenarios(2, 5)] == [
        ("verify-6 drafter", 5, 5),
        ("verify-16x6 drafter", 40, 80),
    ]


def test_the_tools_layouts_and_splits_and_the_errors_that_name_the_form(load_tool):
    tool = load_tool("step_time")
    assert tool._layouts("8x4,16x1,8x4/8x1") == [
        ((8, 4), None),
        ((16, 1), None),
        ((8, 4), (8, 1)),
    ]
    with pytest.raises(SystemExit, match=r"write each layout as WORLDxTP \(16x4\), a split as"):
        tool._layouts("8:4")
    with pytest.raises(SystemExit, match="its decode tp dividing its prefill tp"):
        tool._layouts("8x2/8x4")
    with pytest.raises(SystemExit, match="a split runs both layouts on the same ranks"):
        tool._layouts("8x4/16x1")


def test_the_physical_floor_does_not_depend_on_the_layout(tiny, plan_once):
    """Another layout: wo_b whole on every rank, one EP row per assignment (each local
    routed-experts call sees one route per row); the experts a token touches are still the
    layer's K."""
    cfg, costs = tiny
    other = {"attn_exit": "all_to_all", "ep_rows": "per_assignment"}  # wo_b whole, a row a route
    gm, ctx = plan_once(cfg, {"tp": 4, "ep": 8, **other}, world_size=8)[:2]
    scenario = Scenario("verify", 48, 96)
    ours, theirs = (step_time(c, DEVICES["950dt"], scenario) for c in (costs, step_costs(gm, ctx)))
    assert theirs.physical_floor == pytest.approx(ours.physical_floor, rel=1e-12)
    assert theirs.layout_floor != pytest.approx(ours.layout_floor)  # the layouts do differ


def test_the_npu_lowering_is_costed_with_torch_npus_ops(plan_once):
    """tiny-swa as released, handed to npugraph_ex: the routed experts as three grouped matmuls
    in their MX A8W4 form -- each reads its experts' FP4 codes and scales as released, at the
    step's touched fraction ("experts": `expert_bytes`), no decoded copy made -- of the rows'
    e4m3 codes (a byte a value) with their scale pairs, costed at the fp8 rate as a matmul of
    every row through one group (2 R K N FLOPs); the FP8 linears as MXFP8 `npu_quant_matmul`s
    on the fp8 rate."""
    register_npu_ops()
    cfg = ModelConfig.from_name("tiny-swa", **dict((*SINKHORN_3, *ONE_LAYER, *AS_RELEASED)))
    options = {"tp": 4, "ep": 8, "lowering": "npugraph_ex"}
    gm, ctx = plan_once(cfg, options, world_size=8)[:2]
    costs = step_costs(gm, ctx)
    ops = {op.node: op for op in costs.ops}
    e_local, inter, dim = cfg.n_routed_experts // 8, cfg.moe_inter_dim, cfg.dim
    assert (costs.experts, costs.top_k) == (cfg.n_routed_experts, cfg.n_activated_experts)
    grouped = [n for n in gm.graph.nodes if str(n.target) == "npu.npu_grouped_matmul.default"]
    assert len(grouped) == 3
    assert not [n for n in gm.graph.nodes if str(n.target) == "npu.npu_anti_mx_quant.default"
                and n.kwargs.get("src_type") == E2M1]  # fmt: skip
    for node in grouped:
        op = ops[node.name]
        (x,), (weight,) = node.args[:2]
        assert x.meta["val"].dtype == torch.float8_e4m3fn
        # the packed codes (half a byte a value) and the scales (a byte per 32 values; where a
        # row has an odd count of blocks, w2's here, padded to pairs by a `constant_pad_nd` of
        # the scales, which reads them)
        packed, scales = e_local * inter * dim // 2, e_local * inter * dim // 32
        (scale,) = node.kwargs["antiquant_scale"]
        chain = []
        while scale.op == "call_function":
            chain.append(scale)
            scale = scale.all_input_nodes[0]
        pads = [ops[n.name] for n in chain if n.target is torch.ops.aten.constant_pad_nd.default]
        assert op.kind == "experts"
        assert op.expert_bytes + sum(pad.weight_bytes for pad in pads) == packed + scales
        assert op.weight_bytes == 0 and op.operand == "fp8"
        # it reads its rows x [R, K] (a byte a value), their scale pairs (a byte per 32) and the
        # group counts (int64), and does 2 R K N FLOPs
        pad_bytes = sum(pad.written for pad in pads)
        k = x.meta["val"].shape[1]  # a row: k code bytes, then 2 * ceil(k / 64) scale bytes
        x_bytes = (op.read - 8 * e_local - pad_bytes) * k / (k + 2 * -(-k // 64))
        assert x_bytes.free_symbols == {T}
        n = weight.meta["val"].shape[2]
        assert sympy.simplify(op.flops - 2 * x_bytes * n) == 0
    quant = [op for name, op in ops.items() if name.startswith("npu_quant_matmul")]
    assert quant and all(op.kind == "matmul" and op.operand == "fp8" for op in quant)


def test_the_tools_plot_draws_each_layer_against_its_floors(tiny, load_tool, tmp_path, capsys):
    """`step_time.py --plot`: the records carry each layer's time and floors, which the plot
    draws, one panel per scenario."""
    tool = load_tool("step_time")
    _, costs = tiny
    records = [tool.report(costs, "950dt", s, 0) for s in tool.scenarios(2)]
    capsys.readouterr()
    layers = {r["layer"]: r for r in records[0]["layers"]}
    assert set(layers) == {None, 0}
    assert layers[0]["seconds"] >= layers[0]["layout_floor"] > 0
    path = tmp_path / "layers.png"
    tool.plot_layers({"sp": records, "sp npugraph_ex": records}, path, "tiny-swa")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
