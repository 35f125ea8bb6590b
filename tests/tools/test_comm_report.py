"""tools/comm_report.py on tiny-swa (`deepseek_v41.testing.presets.compile_config()`: costs are per layer): the
report's JSON layout, the seed, sp and replicated configurations costed from their graphs, and
the plot written. The
plans are tests/report/test_accounting.py's (the same graphs, planned once on the worker both
files run on)."""

from __future__ import annotations

import argparse
import json

from dsv41_compile.deepseek_v41.testing.presets import compile_config


def test_report_json_and_plot(tmp_path, plan_once, load_tool):
    tool = load_tool("comm_report")
    args = argparse.Namespace(
        preset="tiny-swa", tp=4, ep=8, dp=2, ep_dispatch="padded", ep_rows="auto",
        attn_exit="auto", attn_entry="auto",
    )  # fmt: skip
    cfg = compile_config()
    doc = json.loads(json.dumps(tool.report(args, plan=plan_once, cfg=cfg)))  # JSON-serialisable
    assert [s["name"] for s in doc["scenarios"]] == ["decode", "dspark", "prefill"]
    assert [s["tokens_per_dp_group"] for s in doc["scenarios"]] == [4, 80, 4096]
    assert doc["options"]["seed"]["ep_rows"] == "per_assignment"
    assert doc["options"]["sp"]["ep_rows"] == doc["options"]["replicated"]["ep_rows"] == "auto"
    assert doc["options"]["seed"]["attn_exit"] == "reduce_scatter"
    assert doc["options"]["seed"]["attn_entry"] == "input"
    assert doc["choices"]["sp"] == [
        # D = 64: the q and kv latents (32 + 32) tie with the input, which has one collective
        "attn_entry='auto': the input, 256 B per token row, against 256 B for the cheapest cut",
        "attn_exit='auto': reduce_scatter, 10.002 us per layer against 10.003 us all_to_all on "
        "950dt at 8 rows per step (10 us per collective; 192 B per token against 48 B; "
        "all_to_all would read +12,288 B of wo_b per layer)",
        "ep_rows='auto': per_rank, 3,920 B per token (padded, dispatch + combine) "
        "against 7,280 B per_assignment",
        # the 131 kB fp32 head is read faster than its logits would gather
        "head='auto': replicated, 0.0 us per step against 10.0 us vocab_sharded on 950dt at 8 "
        "rows per step (the head 131,072 B; sharded: 32,768 B per rank and an AllGather of "
        "4,096 B per rank)",
        # its 24,576 B of weights are read faster than two collectives' latency
        "shared_expert='auto': whole, 0.0 us per layer against 20.0 us split on 950dt at 8 "
        "rows per step (24,576 B of weights per layer whole, 6,144 B per rank split; split "
        "gathers its input and reduce-scatters its output, 1,536 B each per rank)",
    ]
    assert doc["device"] == "950dt"  # the tool's default; args carry none here
    for scenario in doc["scenarios"]:
        seed, sp, rep = (scenario["layouts"][k] for k in ("seed", "sp", "replicated"))
        for layout in (seed, sp, rep):  # the step-time model's prediction beside the bytes
            low, high = layout["step_seconds"]["10us"], layout["step_seconds"]["30us"]
            assert high > low >= layout["layout_floor_seconds"] > 0
        for layout in (seed, sp, rep):
            assert {"bytes_per_layer_per_rank", "flops_per_layer_per_rank", "collectives"} <= set(
                layout
            )
        assert set(seed["collectives"]) == {
            "all_gather(tp)", "reduce_scatter(tp)", "all_to_all(ep)"
        }  # fmt: skip
        assert set(sp["collectives"]) == {
            "all_gather(tp)", "reduce_scatter(tp)", "all_to_all(ep)"
        }  # fmt: skip
        assert set(rep["collectives"]) == {"all_reduce(tp)", "all_gather(tp)", "all_to_all(ep)"}
        # the seed's attention boundary is its lower bound when tp divides T; sp and the
        # baseline move the same EP bytes (the same options), fewer than the seed's
        boundary = sum(
            seed["collectives"][k]["bytes_sent"] for k in ("all_gather(tp)", "reduce_scatter(tp)")
        )
        assert boundary == scenario["attention_lower_bound_bytes"]
        assert sp["collectives"]["all_to_all(ep)"] == rep["collectives"]["all_to_all(ep)"]
        ep_bytes = [c["collectives"]["all_to_all(ep)"]["bytes_sent"] for c in (sp, seed)]
        assert ep_bytes[0] < ep_bytes[1]
        assert sp["bytes_per_layer_per_rank"] < rep["bytes_per_layer_per_rank"]
        assert sp["bytes_per_layer_per_rank"] < seed["bytes_per_layer_per_rank"]
    path = tmp_path / "bytes.png"
    tool.plot(doc, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
