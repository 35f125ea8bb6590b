"""Bytes and FLOPs per layer per rank of the sp layout against the replicated baseline and the
seed layout.

Three configurations: "sp" (layout="sp" with the cuts the options choose, `--ep-rows`, "auto"
by default), "replicated" (the all-reduce baseline, with the same EP options: like for like)
and "seed" (the seed's layout exactly: sp, the wo_b partial reduce-scattered, one EP row
per assignment). The Engram tables are placed by `--engram` in sp and the seed (the
seed predates Engram), replicated in the baseline. Each is planned for rank 0 of a fake world (`planning.plan_rank`: meta tensors, a
`fake` process group, nothing allocated, nothing run) and costed from their rewritten graphs
(`accounting.py`: ring all-gather / reduce-scatter / all-reduce, pairwise all-to-all; FLOPs of
the matmul-like nodes). Scenarios give the tokens per DP group: decode (4 requests x 1 token),
dspark (16 requests x 5 tokens: a speculative verification batch), prefill (2 requests x 2048
tokens). The attention boundary's lower bound is what any correct SP scheme must move per
rank: the other ranks' attention-input rows in ((T - Tl) D activation bytes received) and the
other ranks' rows of the fp32 output partial out ((T - Tl) D 4 bytes sent).

    .venv/bin/python tools/comm_report.py --preset flash --tp 4 --ep 8 --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dsv41_compile.deepseek_v41.model import ModelConfig
from dsv41_compile.deepseek_v41.testing.presets import SEED_LAYOUT
from dsv41_compile.devices import DEVICES, LATENCIES, latency_label
from dsv41_compile.moe.stats import ep_layers
from dsv41_compile.planning import plan_rank
from dsv41_compile.report.accounting import graph_costs, per_layer_formulas, summarize
from dsv41_compile.report.cli import run, tool_parser
from dsv41_compile.report.provenance import provenance
from dsv41_compile.report.step_time import Scenario, step_costs, step_time

SCENARIOS = (("decode", 4, 1), ("dspark", 16, 5), ("prefill", 2, 2048))
MAX_LEN = 4096  # cache positions per request: sizes the compressed attention over the cache
CONFIGS = ("seed", "sp", "replicated")


def config_options(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """The backend options of a configuration (module docstring)."""
    options = {"tp": args.tp, "ep": args.ep, "ep_dispatch": args.ep_dispatch, "lowering": "eager"}
    engram = getattr(args, "engram", "auto")
    if engram != "auto":  # the backend's choice unless asked
        options["engram"] = engram
    if config == "seed":
        return {**options, **SEED_LAYOUT}
    # the baseline all-reduces and gathers nothing: its attention cuts are "auto" (none)
    exit, entry = (args.attn_exit, args.attn_entry) if config == "sp" else ("auto", "auto")
    if config == "replicated" and engram != "auto":  # the baseline replicates the tables
        options["engram"] = "replicated"
    return {
        **options, "layout": config, "ep_rows": args.ep_rows, "attn_exit": exit,
        "attn_entry": entry,
    }  # fmt: skip


KINDS = (
    "all_gather(tp)", "reduce_scatter(tp)", "all_to_all(tp)", "all_reduce(tp)", "all_to_all(ep)"
)  # fmt: skip


def model_config(preset: str, numerics: str) -> ModelConfig:
    """The preset; with the official numerics, as the released checkpoint runs it (bf16, its
    weights held as released), where the collectives the quantisation feeds move FP8 rows."""
    if numerics == "bf16":
        return ModelConfig.from_name(preset)
    return ModelConfig.from_name(
        preset, dtype="bfloat16", numerics="official", weight_format="released"
    )


def attention_lower_bound(cfg: ModelConfig, tokens: int, tp: int) -> int:
    tl = -(-tokens // tp)
    rows = max(tokens - tl, 0)
    act = torch.empty((), dtype=cfg.torch_dtype).element_size()
    return rows * cfg.dim * act + rows * cfg.dim * 4


def report(
    args: argparse.Namespace, plan: Callable[..., Any] = plan_rank, cfg: ModelConfig | None = None
) -> dict:
    """The report as a JSON-ready dict; `plan` plans one rank (`planning.plan_rank`), `cfg` is
    the model (`args.preset` when None)."""
    cfg = cfg or model_config(args.preset, getattr(args, "numerics", "bf16"))
    world = args.ep if args.ep > 1 else args.tp * args.dp
    costs, seconds, times = {}, {}, {}
    choices = {}
    device = DEVICES[getattr(args, "device", "950dt")]
    for config in CONFIGS:
        start = time.perf_counter()
        gm, ctx, _ = plan(
            cfg, config_options(config, args), world_size=world, max_len=MAX_LEN,
            progress=f"planning {config}",
        )  # fmt: skip
        costs[config] = graph_costs(gm, ctx)
        times[config] = step_costs(gm, ctx)
        seconds[config] = time.perf_counter() - start
        choices[config] = sorted({*ctx.choices.values(), *(info.why for info in ep_layers(ctx))})
    scenarios = []
    for name, requests, length in SCENARIOS:
        tokens = requests * length
        layouts = {config: summarize(costs[config], tokens) for config in CONFIGS}
        step = Scenario(name, tokens, tokens * (world // args.tp))  # every DP group as busy
        for config in CONFIGS:
            predicted = [
                step_time(times[config], device.with_latency(latency), step)
                for latency in LATENCIES
            ]
            layouts[config]["step_seconds"] = {
                latency_label(latency): t.seconds for latency, t in zip(LATENCIES, predicted)
            }
            layouts[config]["layout_floor_seconds"] = predicted[0].layout_floor
        scenarios.append(
            {
                "name": name,
                "requests": requests,
                "tokens_per_request": length,
                "tokens_per_dp_group": tokens,
                "attention_lower_bound_bytes": attention_lower_bound(cfg, tokens, args.tp),
                "layouts": layouts,
            }
        )
    doc = {
        "preset": args.preset,
        "numerics": cfg.numerics,
        "tp": args.tp,
        "ep": args.ep,
        "world_size": world,
        "ep_dispatch": args.ep_dispatch,
        "device": device.name,
        "options": {config: config_options(config, args) for config in CONFIGS},
        "choices": choices,
        "planning_seconds": seconds,
        "formulas_per_layer_per_rank": {
            config: per_layer_formulas(costs[config]) for config in CONFIGS
        },
        "assumptions": (
            "rank 0 (a full token shard); ring all-gather / reduce-scatter / all-reduce, "
            "pairwise all-to-all; exact EP counts at their expectation under uniform routing, padded "
            "Tl_max = ceil(T/tp); routed-expert FLOPs count every row handed to the kernel; "
            f"a cache of {MAX_LEN} positions per request"
        ),
        "scenarios": scenarios,
    }
    if cfg.num_nextn_predict_layers:
        doc["dspark"] = dspark_report(args, cfg, plan, costs["sp"], world)
    return doc


def _total(costs: list, tokens: int) -> int:
    """Bytes a rank sends in one call of a planned program at T = `tokens`."""
    return int(sum(p["bytes_sent"] for p in summarize(costs, tokens)["parts"].values()))


def dspark_report(
    args: argparse.Namespace, cfg: ModelConfig, plan: Callable[..., Any], backbone: list, world: int
) -> dict:
    """Per speculative step in the sp layout: the drafter's call (`dspark_block_size` rows per
    request, its stages and the shared head; `program="drafter"`) and what the verify call
    (`block_size + 1` rows per request) moves beyond the backbone's call: the captured hidden
    states the drafter reads, gathered to every rank."""
    options = config_options("sp", args)
    seconds, costs = {}, {}
    for program in ("drafter", "verify"):
        start = time.perf_counter()
        gm, ctx, _ = plan(
            cfg, options, world_size=world, max_len=MAX_LEN, program=program,
            progress=f"planning {program}",
        )  # fmt: skip
        costs[program] = graph_costs(gm, ctx)
        seconds[program] = time.perf_counter() - start
    block = cfg.dspark_block_size
    steps = []
    for name, requests in (("decode", 4), ("dspark", 16)):
        draft_rows, verify_rows = requests * block, requests * (block + 1)
        drafter = summarize(costs["drafter"], draft_rows)
        verify_bytes = _total(costs["verify"], verify_rows)
        steps.append(
            {
                "name": name,
                "requests": requests,
                "drafter_rows": draft_rows,
                "drafter_bytes": _total(costs["drafter"], draft_rows),
                "drafter_collectives": drafter["collectives"],
                "drafter_stages": drafter["layers"],
                "verify_rows": verify_rows,
                "verify_bytes": verify_bytes,
                "capture_bytes": verify_bytes - _total(backbone, verify_rows),
            }
        )
    return {"planning_seconds": seconds, "steps": steps}


def print_dspark(doc: dict) -> None:
    dspark = doc["dspark"]
    print(
        "DSpark, per speculative step and rank (sp): planned the drafter in "
        f"{dspark['planning_seconds']['drafter']:.1f} s, the verify call in "
        f"{dspark['planning_seconds']['verify']:.1f} s"
    )
    for step in dspark["steps"]:
        print(
            f"  {step['name']}: {step['requests']} requests; drafter call "
            f"(T {step['drafter_rows']}, {step['drafter_stages']} stages + head) "
            f"{_fmt(step['drafter_bytes'])}B; verify call (T {step['verify_rows']}) "
            f"{_fmt(step['verify_bytes'])}B, of which the drafter's captures "
            f"{_fmt(step['capture_bytes'])}B"
        )


def _fmt(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def print_tables(doc: dict) -> None:
    print(
        f"{doc['preset']}: tp={doc['tp']} ep={doc['ep']} world={doc['world_size']} "
        f"({doc['ep_dispatch']} EP dispatch); per decoder layer, per rank; planned in "
        + ", ".join(f"{k} {v:.1f} s" for k, v in doc["planning_seconds"].items())
    )
    print(f"assumptions: {doc['assumptions']}")
    for config, options in doc["options"].items():
        chosen = "; ".join(doc["choices"][config])
        print(f"  {config:<11} {options['layout']}: {chosen}")
    print("per layer per rank, in T (tokens per DP group):")
    for config, formulas in doc["formulas_per_layer_per_rank"].items():
        for key, formula in formulas.items():
            print(f"  {config:<11} {key:<26} {formula}")
    print()
    for sc in doc["scenarios"]:
        by = [sc["layouts"][k] for k in CONFIGS]
        print(
            f"{sc['name']}: {sc['requests']} requests x {sc['tokens_per_request']} tokens "
            f"= T {sc['tokens_per_dp_group']} per DP group"
        )
        print(
            f"  {'bytes sent':<28}" + "".join(f"{c:>12}" for c in CONFIGS)
            + f"{'sp/repl':>9}{'sp/seed':>9}"
        )  # fmt: skip
        for kind in KINDS:
            values = [c["collectives"].get(kind, {}).get("bytes_sent", 0) for c in by]
            if any(values):
                _row(kind, values)
        _row("total per layer", [c["bytes_per_layer_per_rank"] for c in by])
        attn = sum(
            sc["layouts"]["seed"]["collectives"].get(k, {}).get("bytes_sent", 0)
            for k in ("all_gather(tp)", "reduce_scatter(tp)")
        )
        print(
            f"  attention boundary: seed moves {_fmt(attn)}B (AllGather + ReduceScatter), "
            f"the seed cut's lower bound {_fmt(sc['attention_lower_bound_bytes'])}B"
        )
        for part in ("entry", "exit"):
            _row(f"{part} (per call)", [c["parts"][part]["bytes_sent"] for c in by])
        _print_tables(sc, by, doc["tp"])
        for latency in LATENCIES:
            key = latency_label(latency)
            _row(
                f"step on {doc['device']}, {key} (ms)",
                [c["step_seconds"][key] * 1e3 for c in by],
                unit="",
            )
        _row("layout floor (ms)", [c["layout_floor_seconds"] * 1e3 for c in by], unit="")
        print(f"  {'FLOPs':<28}")
        _row("attention half", [c["attention_flops_per_layer_per_rank"] for c in by])
        _row("MoE half", [c["moe_flops_per_layer_per_rank"] for c in by])
        print()


def _print_tables(sc: dict, by: list[dict], tp: int) -> None:
    """The column-split tables' exchange (Engram) per layer that moves it (the first Engram
    layer, or the MoE layer before it whose EP all-to-alls it rides in), beside that layer's
    other collectives; a replicated table exchanges nothing."""
    tokens = -(-sc["tokens_per_dp_group"] // tp)  # the rank's token shard, Tl
    for config, cost in zip(CONFIGS, by):
        tables = cost["tables"]
        if not tables["layers"]:
            print(f"  {config:<11} Engram tables replicated (or none): no exchange")
            continue
        sent = tables["bytes_sent_per_table_layer"]
        print(
            f"  {config:<11} Engram exchange, in layer {tables['layers']}: sent "
            f"{_fmt(sent)}B ({_fmt(sent / tokens)}B per token of the rank's shard), received "
            f"{_fmt(tables['bytes_received_per_table_layer'])}B; the layer's other collectives "
            f"{_fmt(tables['other_bytes_sent_per_table_layer'])}B"
        )


def _row(label: str, values: list[float], unit: str = "B") -> None:
    """seed, sp, replicated, then sp/replicated and sp/seed; `unit` "": plain numbers."""
    seed, sp, rep = values
    ratios = "".join(f"{sp / b:>9.2f}" if b else f"{'-':>9}" for b in (rep, seed))
    shown = [_fmt(v) if unit else f"{v:.3f}" for v in values]
    print(f"  {label:<28}" + "".join(f"{v:>12}" for v in shown) + ratios)


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = doc["scenarios"]
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4 * len(scenarios), 4))
    for ax, sc in zip(axes, scenarios):
        bottom = [0.0] * len(CONFIGS)
        for kind in KINDS:
            values = [
                sc["layouts"][config]["collectives"].get(kind, {}).get("bytes_sent", 0) / 1e6
                for config in CONFIGS
            ]
            if any(values):
                ax.bar(CONFIGS, values, bottom=bottom, label=kind)
                bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_title(f"{sc['name']} (T={sc['tokens_per_dp_group']})")
        ax.set_ylabel("MB sent per layer per rank")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(f"{doc['preset']}: tp={doc['tp']}, ep={doc['ep']} ({doc['ep_dispatch']} dispatch)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument(
        "--preset", default="tiny",
        choices=("tiny", "tiny-swa", "flash", "tiny-dspark", "flash-dspark"),
        help="a preset with DSpark stages also reports the drafter's bytes per step",
    )  # fmt: skip
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--ep", type=int, default=8, help="1 or the world size")
    parser.add_argument("--dp", type=int, default=2, help="DP groups when ep=1")
    parser.add_argument("--ep-dispatch", choices=("exact", "padded"), default="exact")
    parser.add_argument(
        "--device", default="950dt", choices=sorted(DEVICES),
        help="the device the step times are predicted on (docs/devices.md)",
    )  # fmt: skip
    parser.add_argument(
        "--ep-rows", choices=("auto", "per_rank", "per_assignment"), default="auto",
        help="sp's and the baseline's EP rows (the seed: per_assignment)",
    )  # fmt: skip
    parser.add_argument(
        "--attn-entry", choices=("auto", "input"), default="auto",
        help="sp's attention entry: the cheapest cut (auto) or the normed input",
    )  # fmt: skip
    parser.add_argument(
        "--attn-exit", choices=("auto", "reduce_scatter", "all_to_all"), default="auto",
        help="sp's attention exit (the seed: reduce_scatter)",
    )  # fmt: skip
    parser.add_argument(
        "--engram", choices=("auto", "replicated", "sharded", "host"), default="auto",
        help="the Engram tables' placement, in every configuration the layout allows it",
    )  # fmt: skip
    parser.add_argument(
        "--numerics", choices=("bf16", "official"), default="bf16",
        help="official: bf16, the official FP8 numerics and the weights as released (FP8 rows "
        "moved where a quantisation reads them)",
    )  # fmt: skip
    parser.add_argument("--json", help="write the report as JSON here")
    parser.add_argument("--plot", help="draw bytes per collective kind per layer (PNG) here")
    args = parser.parse_args()
    print(provenance(kind="Counted"), flush=True)  # the docs/benchmarks.md block's header
    doc = report(args)
    print_tables(doc)
    if "dspark" in doc:
        print_dspark(doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot(doc, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    run(main)
