"""Predicted step time of one rank's program on a device, beside the layout's and the physical
floor, for four serving scenarios.

Rank 0 of a fake world is planned on meta tensors (`planning.plan_rank`: nothing allocated,
nothing run) and its rewritten graph costed by `report.step_time` on a named device
(`devices.DEVICES`; docs/devices.md gives each figure's source) at the two assumed collective
latencies (`devices.LATENCIES`). The scenarios (rows in the busiest DP group; rows over the world,
which the routed experts see), with the cache planned at `--context` positions per request:

- decode-1: one request decoding one token;
- verify-6: one request verifying 6 DSpark rows;
- verify-16x6: 16 requests verifying 6 rows each, spread over the DP groups;
- prefill-2x2048: two requests of 2048 tokens, spread over the DP groups.

Two configurations side by side, as `tools/comm_report.py` names them: `sp` (the cuts the
options' "auto" picks, and any `--option`) and `seed` (the seed's layout exactly); with
`--lowering npugraph_ex` (or `torchair`), `sp` also as that NPU lowering hands it over:
torch_npu's ops in place of the model's (the routed experts' FP4 weights decoded on every call,
then a grouped matmul; the FP8 linears as MXFP8 quantised matmuls), costed against the eager
plan's floors.

With a DSpark model (`--preset flash-dspark`), the drafter's own program in each verify
scenario is costed too and shown apart (`sp drafter`: `dspark_block_size` rows per request,
the requests spread as the verify call's; `planning.plan_rank(program="drafter")`).

    .venv/bin/python tools/step_time.py --preset flash --tp 4 --ep 8 --device 950dt

`--layouts 8x4,8x1,16x4,32x8,8x4/8x1` compares layouts instead: each `WORLDxTP` planned with
the experts over the world (ep = WORLD) and the options' cuts, one table of every scenario's
predicted step at both latencies, the collectives per layer, the weights a rank holds and the
requests of `--context` positions whose cache fits beside them on the device
(`StepCosts.requests_that_fit`: activations not counted) and in the world (a DP group's ranks
hold the same requests: V4.1's one KV head is not split by tp). `PREFILLxTP/DECODExTP` is a split
(`serving.Split`): the prefill scenario in the first layout, the others in the second, both
programs' weights held (what they hold alike, once: `StepCosts.held_weights`), and the
hand-over of a request (a copy of its cache rows in device
memory; no byte between ranks). A world beyond the device's `ranks_per_node` costs the
collectives that cross nodes at the link between nodes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

from dsv41_compile.deepseek_v41.model import ModelConfig
from dsv41_compile.deepseek_v41.testing.batches import Request
from dsv41_compile.deepseek_v41.testing.presets import SEED_LAYOUT
from dsv41_compile.devices import DEVICES, LATENCIES, device_named, latency_label
from dsv41_compile.planning import plan_rank
from dsv41_compile.report.cli import run, tool_parser
from dsv41_compile.report.provenance import provenance
from dsv41_compile.report.step_time import Scenario, StepCosts, StepTime, step_costs, step_time
from dsv41_compile.testing.torchair_standin import register_npu_ops

REQUESTS = (
    ("decode-1", 1, 1),
    ("verify-6", 1, 6),
    ("verify-16x6", 16, 6),
    ("prefill-2x2048", 2, 2048),
)
"""(name, requests, rows per request)."""


def scenarios(dp: int) -> list[Scenario]:
    """The scenarios for `dp` DP groups: the requests spread evenly, the busiest group's rows."""
    return [
        Scenario(name, math.ceil(requests / dp) * rows, requests * rows)
        for name, requests, rows in REQUESTS
    ]


def drafter_scenarios(dp: int, block: int) -> list[Scenario]:
    """The DSpark drafter's call in each verify scenario: `block` rows per request (its draft
    block), the requests spread as the verify call's."""
    return [
        Scenario(f"{name} drafter", math.ceil(requests / dp) * block, requests * block)
        for name, requests, _ in REQUESTS
        if name.startswith("verify")
    ]


def plan_costs(
    cfg: ModelConfig,
    options: dict[str, Any],
    *,
    world_size: int,
    context: int,
    program: str = "backbone",
) -> tuple[StepCosts, float]:
    """Rank 0's step costs of `program` ("backbone", or DSpark's "drafter") and the seconds
    planning took."""
    began = time.perf_counter()
    gm, ctx, _ = plan_rank(
        cfg, options, world_size=world_size, requests=[Request(0, [1], 0)], max_len=context,
        program=program,
        progress=f"planning {program} tp={options.get('tp')} {options.get('lowering', 'eager')}",
    )  # fmt: skip
    return step_costs(gm, ctx), time.perf_counter() - began


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f}"


def report(
    costs: StepCosts,
    device_name: str,
    scenario: Scenario,
    top: int,
    floors: StepCosts | None = None,
) -> dict[str, Any]:
    """The scenario's prediction at both latencies, printed; returned as a JSON record. The
    floors are `floors`' where given (an NPU lowering's program is costed against the floors
    of the same layout's eager plan: they do not depend on how the ops are lowered)."""
    device = device_named(device_name)
    times = [step_time(costs, device.with_latency(latency), scenario) for latency in LATENCIES]
    first: StepTime = times[0]
    if floors is not None:
        floor = step_time(floors, device, scenario)
        first = dataclasses.replace(
            first,
            layout_floor=floor.layout_floor,
            physical_floor=floor.physical_floor,
            compute_floor=floor.compute_floor,
        )
    per_layer = first.layer_collectives / max(costs.layers, 1)
    layer_floors = (floor if floors is not None else first).layers
    print(
        f"{scenario.name:<15} T={scenario.rows:<5} "
        + " ".join(
            f"{_ms(t.seconds)} ms @{latency_label(t.device.collective_latency)}" for t in times
        )
        + f"  layout floor {_ms(first.layout_floor)} ms (compute {_ms(first.compute_floor)} ms)"
        + f"  physical floor {_ms(first.physical_floor)} ms"
        + f"  HBM {first.hbm_bytes / 1e9:7.2f} GB  collectives {first.collectives}"
        + f" ({per_layer:.2f} per layer)"
    )
    for label, chosen in (
        ("ops", first.top(top, collectives=False)),
        ("collectives", first.top(top, collectives=True)),
    ):
        print(
            f"    top {label}: "
            + ", ".join(f"{op.node} ({op.kind}) {s * 1e6:.1f}us" for s, op in chosen)
        )
    return {
        "scenario": scenario.name,
        "rows": scenario.rows,
        "world_rows": scenario.world_rows,
        "seconds": {latency_label(t.device.collective_latency): t.seconds for t in times},
        "hbm_seconds": first.hbm_seconds,
        "compute_seconds": first.compute_seconds,
        "collective_seconds": {
            latency_label(t.device.collective_latency): t.collective_seconds for t in times
        },
        "collectives": first.collectives,
        "collectives_per_layer": per_layer,
        "hbm_bytes": first.hbm_bytes,
        "layout_floor": first.layout_floor,
        "compute_floor": first.compute_floor,
        "physical_floor": first.physical_floor,
        # per decoder layer (None: the embedding, the head) at the first latency
        "layers": [
            {
                "layer": layer,
                "seconds": part.seconds,
                "layout_floor": layer_floors[layer].layout_floor,
                "compute_floor": layer_floors[layer].compute_floor,
            }
            for layer, part in times[0].layers.items()
        ],
        # the prediction over the layout's floor (HBM or compute, the larger) plus the
        # program's own collectives, at each latency
        "over_floor": {
            latency_label(t.device.collective_latency): t.seconds
            / (max(first.layout_floor, first.compute_floor) + t.collective_seconds)
            for t in times
        },
    }


Layout = tuple[tuple[int, int], tuple[int, int] | None]
"""((world, tp), None) for one layout; ((world, prefill tp), (world, decode tp)) for a split."""


def compare_layouts(
    cfg: ModelConfig, layouts: list[Layout], options: dict[str, Any], args: Any
) -> dict[str, Any]:
    """Each layout of `layouts` planned once (ep = world) and costed for every scenario on each
    device of `args.devices`; the comparison tables printed, returned as a JSON record. A split
    (`serving.Split`) takes the prefill scenario from its prefill layout and the others from
    its decode layout, holds both programs' weights (what they hold alike, such as the
    experts, once: `StepCosts.held_weights`) and the decode layout's cache, and hands a
    request over by copying its cache rows in device memory (no byte between ranks:
    `hand_over`)."""
    low, high = (latency_label(latency) for latency in LATENCIES)
    planned: dict[tuple[int, int], tuple[StepCosts, float]] = {}
    for pair in layouts:
        for world, tp in filter(None, pair):
            if (world, tp) in planned:
                continue
            layout = {**options, "tp": tp, "ep": world}
            print(f"planning rank 0 of {args.preset}, {world} ranks, tp={tp} ...", flush=True)
            planned[world, tp] = plan_costs(cfg, layout, world_size=world, context=args.context)
            print(f"    planned in {planned[world, tp][1]:.0f} s", flush=True)
    rows: list[dict[str, Any]] = []
    for name in args.devices:
        device = device_named(name)
        print(
            f"\n{args.preset} on {name} ({device.ranks_per_node} ranks per node), context "
            f"{args.context}, {options}\n\n| layout | scenario | T | predicted, {low} | "
            f"predicted, {high} | collectives per layer | weights per rank | KV per request | "
            "requests per rank | requests in the world | hand-over per request |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|"
        )
        for (world, tp), decode in layouts:
            prefill_costs, seconds = planned[world, tp]
            decode_costs = planned[decode][0] if decode else prefill_costs
            decode_tp = decode[1] if decode else tp
            label = f"TP{tp}/DP{world // tp}/EP{world}"
            held = prefill_costs.held_weight_bytes
            handover: float | None = None
            if decode:  # what the two programs hold alike (the experts, ...) is held once
                held = sum({**prefill_costs.held_weights, **decode_costs.held_weights}.values())
                label = f"prefill {label}, decode TP{decode_tp}/DP{world // decode_tp}/EP{world}"
                handover = 2 * decode_costs.cache_bytes_per_request / device.hbm_bytes_per_s
            fit = decode_costs.requests_that_fit(
                device.hbm_bytes, also_held=held - decode_costs.held_weight_bytes
            )
            prefills = {s.name: s for s in scenarios(world // tp)}
            for scenario in scenarios(world // decode_tp):
                costs = decode_costs
                if scenario.name.startswith("prefill"):
                    costs, scenario = prefill_costs, prefills[scenario.name]
                times = [step_time(costs, device.with_latency(x), scenario) for x in LATENCIES]
                r = {
                    "device": name,
                    "layout": label,
                    "world": world,
                    "tp": tp,
                    "decode_tp": decode_tp,
                    "planned_seconds": seconds,
                    "scenario": scenario.name,
                    "rows": scenario.rows,
                    "seconds": {
                        latency_label(t.device.collective_latency): t.seconds for t in times
                    },
                    "collectives_per_layer": times[0].layer_collectives / max(costs.layers, 1),
                    "held_weight_bytes": held,
                    "cache_bytes_per_request": decode_costs.cache_bytes_per_request,
                    "requests_per_rank": fit,
                    # each decode DP group holds its own requests (its ranks the same ones)
                    "requests_in_world": fit * (world // decode_tp),
                    "handover_seconds": handover,
                }
                rows.append(r)
                moved = "-" if handover is None else f"0 B between ranks, {handover * 1e6:.1f} us"
                print(
                    f"| {label} | {r['scenario']} | {r['rows']} | "
                    f"{r['seconds'][low] * 1e3:.2f} ms | {r['seconds'][high] * 1e3:.2f} ms | "
                    f"{r['collectives_per_layer']:.2f} | {held / 1e9:.1f} GB | "
                    f"{r['cache_bytes_per_request'] / 1e6:.1f} MB | {fit} | "
                    f"{r['requests_in_world']} | {moved} |"
                )
    return {"context": args.context, "options": options, "rows": rows}


def _layouts(text: str) -> list[Layout]:
    def one(item: str) -> tuple[int, int]:
        world, sep, tp = item.partition("x")
        if not (sep and world.isdigit() and tp.isdigit()):
            raise SystemExit(
                f"--layouts {text!r}: write each layout as WORLDxTP (16x4), a split as "
                "WORLDxTP/WORLDxTP (prefill / decode: 8x4/8x1)"
            )
        return int(world), int(tp)

    layouts: list[Layout] = []
    for item in text.split(","):
        prefill, sep, decode = item.partition("/")
        pair = (one(prefill), one(decode) if sep else None)
        if pair[1] is not None and (pair[1][0] != pair[0][0] or pair[0][1] % pair[1][1]):
            raise SystemExit(
                f"--layouts {item!r}: a split runs both layouts on the same ranks, its decode "
                "tp dividing its prefill tp (serving.Split)"
            )
        layouts.append(pair)
    return layouts


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("--preset", default="flash")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--device", default="950dt", choices=sorted(DEVICES))
    parser.add_argument("--context", type=int, default=8192, help="cache positions per request")
    parser.add_argument(
        "--weights", default="released", choices=("released", "dequantized"),
        help="as released (FP8 linears, FP4 experts, the official numerics) or dequantized "
        "to the model's dtype",
    )  # fmt: skip
    parser.add_argument(
        "--option", action="append", default=[], metavar="KEY=VALUE",
        help="a backend option (attn_exit=reduce_scatter, ...); repeatable",
    )  # fmt: skip
    parser.add_argument(
        "--lowering", action="append", default=[], choices=("npugraph_ex", "torchair"),
        help="also cost the sp program as this NPU lowering hands it over (torch_npu's ops; "
        "the floors stay the eager plan's); repeatable",
    )  # fmt: skip
    parser.add_argument("--top", type=int, default=3, help="ops and collectives listed")
    parser.add_argument(
        "--layouts", type=_layouts, metavar="WORLDxTP,...",
        help="compare these layouts (ep = world) instead of sp and seed at --world / --tp",
    )  # fmt: skip
    parser.add_argument(
        "--devices", type=lambda text: text.split(","), metavar="NAME,...",
        help="with --layouts: the devices to cost each plan on (default: --device)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the predictions here")
    parser.add_argument(
        "--plot", type=Path, metavar="PNG",
        help="draw, per decoder layer and scenario, each sp program's predicted time (at the "
        "first latency) against the layout's HBM floor and its compute floor",
    )  # fmt: skip
    args = parser.parse_args()
    print(provenance(kind="Predicted"), flush=True)  # the docs/benchmarks.md block's header
    overrides: dict[str, Any] = {"weight_format": args.weights}
    if args.weights == "released":
        overrides.update(numerics="official", dtype="bfloat16")
    cfg = ModelConfig.from_name(args.preset, **overrides)
    if args.layouts:
        args.devices = args.devices or [args.device]
        for name in args.devices:
            device_named(name)  # an unknown name fails before any plan
        chosen = {"lowering": "eager", **dict(_option(item) for item in args.option)}
        record = compare_layouts(cfg, args.layouts, chosen, args)
        if args.json:
            args.json.write_text(json.dumps(record, indent=2))
        return
    base: dict[str, Any] = {"tp": args.tp, "ep": args.ep, "lowering": "eager"}
    configs = {
        "sp": {**base, **dict(_option(item) for item in args.option)},
        "seed": {**base, **SEED_LAYOUT},
    }
    for lowering in args.lowering:
        register_npu_ops()  # the torch_npu ops the NPU lowerings emit, on CPU
        configs[f"sp {lowering}"] = {**configs["sp"], "lowering": lowering}
    results: dict[str, list[dict[str, Any]]] = {}
    planned: dict[str, StepCosts] = {}
    for name, options in configs.items():
        print(f"planning rank 0 of {args.preset} ({name}) on meta tensors ...", flush=True)
        costs, seconds = plan_costs(cfg, options, world_size=args.world, context=args.context)
        planned[name] = costs
        print(
            f"{name}: {args.preset} ({args.weights}), {options}, world {args.world}, context "
            f"{args.context}, on {args.device} (planned in {seconds:.0f} s)"
        )
        floors = planned["sp"] if options["lowering"] != "eager" else None
        results[name] = [
            report(costs, args.device, scenario, args.top, floors)
            for scenario in scenarios(args.world // args.tp)
        ]
    drafted: list[tuple[Scenario, dict[str, Any]]] = []
    if cfg.num_nextn_predict_layers:  # a DSpark model: its drafter's call in each verify step
        print(f"planning rank 0 of {args.preset} (sp drafter) on meta tensors ...", flush=True)
        costs, seconds = plan_costs(
            cfg, configs["sp"], world_size=args.world, context=args.context, program="drafter"
        )
        print(f"sp drafter: planned in {seconds:.0f} s")
        for scenario in drafter_scenarios(args.world // args.tp, cfg.dspark_block_size):
            drafted.append((scenario, report(costs, args.device, scenario, args.top)))
        results["sp drafter"] = [record for _, record in drafted]
    low, high = (latency_label(latency) for latency in LATENCIES)
    print(
        f"\n| scenario | config | predicted, {low} | predicted, {high} | layout floor (HBM) | "
        "compute floor | over floor + collectives | physical floor | HBM read+written | "
        "collectives per layer |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, scenario in enumerate(scenarios(args.world // args.tp)):
        for name in configs:
            print(_row(scenario.name, name, results[name][i]))
    for scenario, record in drafted:  # shown apart: the drafter's own program
        print(_row(scenario.name, "sp drafter", record))
    if args.json:
        args.json.write_text(json.dumps({"configs": configs, "scenarios": results}, indent=2))
    if args.plot:
        plot_layers(results, args.plot, f"{args.preset}, tp={args.tp}, ep={args.ep}, {args.device}")
        print(f"wrote {args.plot}")


def plot_layers(results: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    """One panel per scenario: per decoder layer, the predicted time of each sp program (the
    eager plan and each NPU lowering) and the two floors of the eager plan's layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name in results if name.startswith("sp") and name != "sp drafter"]
    scenarios_ = results[names[0]]
    fig, axes = plt.subplots(len(scenarios_), 1, figsize=(10, 3 * len(scenarios_)), squeeze=False)
    for i, (ax,) in enumerate(axes):

        def in_order(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
            # the decoder layers by index (a record per layer, in graph order of first use)
            return sorted((r for r in records if r["layer"] is not None), key=lambda r: r["layer"])

        floors = in_order(results["sp"][i]["layers"])
        x = [r["layer"] for r in floors]
        for name in names:
            layers = in_order(results[name][i]["layers"])
            ax.plot(x, [r["seconds"] * 1e3 for r in layers], marker=".", label=f"{name}")
        ax.plot(x, [r["layout_floor"] * 1e3 for r in floors], "k--", label="layout floor (HBM)")
        ax.plot(x, [r["compute_floor"] * 1e3 for r in floors], "k:", label="compute floor")
        ax.set_title(f"{scenarios_[i]['scenario']} ({title})")
        ax.set_ylabel("ms per layer")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    axes[-1][0].set_xlabel("decoder layer")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _row(scenario: str, config: str, r: dict[str, Any]) -> str:
    """A row of the tool's table (its header in `main`)."""
    low, high = (latency_label(latency) for latency in LATENCIES)
    over = r["over_floor"]
    return (
        f"| {scenario} | {config} | {r['seconds'][low] * 1e3:.2f} ms | "
        f"{r['seconds'][high] * 1e3:.2f} ms | {r['layout_floor'] * 1e3:.2f} ms | "
        f"{r['compute_floor'] * 1e3:.2f} ms | {over[low]:.2f}x / {over[high]:.2f}x | "
        f"{r['physical_floor'] * 1e3:.2f} ms | {r['hbm_bytes'] / 1e9:.1f} GB | "
        f"{r['collectives_per_layer']:.2f} |"
    )


def _option(item: str) -> tuple[str, Any]:
    key, sep, value = item.partition("=")
    if not sep:
        raise SystemExit(f"--option {item!r}: write it as KEY=VALUE")
    return key, int(value) if value.isdigit() else value


if __name__ == "__main__":
    run(main)
