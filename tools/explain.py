"""Print the sharding plan and the rewritten per-rank graph of a preset for a given tp.

Runs in one process on a fake process group with the model on meta tensors (`planning.py`: no
weights, no devices, no second process; `--preset flash` plans the real sizes): the graph is
the one every rank compiles; only the `tp_rank` input differs between ranks.
"""

from __future__ import annotations

import time
from collections import Counter

from dsv41_compile.core.collectives import collective_kind
from dsv41_compile.core.meta import REGION
from dsv41_compile.core.placements import format_placement
from dsv41_compile.deepseek_v41.model import ModelConfig
from dsv41_compile.moe.stats import ep_layers
from dsv41_compile.planning import plan_rank
from dsv41_compile.report.cli import run, tool_parser
from dsv41_compile.report.dump import graph_labels, graph_text, write_dump
from dsv41_compile.report.graph_printer import format_graph


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=None, help="1 or the world size (default)")
    parser.add_argument("--ep-dispatch", choices=("auto", "exact", "padded"), default="auto")
    parser.add_argument("--ep-rows", choices=("auto", "per_rank", "per_assignment"), default="auto")
    parser.add_argument("--attn-entry", choices=("auto", "input"), default="auto")
    parser.add_argument(
        "--attn-exit", choices=("auto", "reduce_scatter", "all_to_all"), default="auto"
    )
    parser.add_argument("--layer", type=int, default=1, help="decoder layer to print in full")
    parser.add_argument(
        "--embedding", choices=("replicated", "vocab_sharded"), default="replicated"
    )
    parser.add_argument("--layout", choices=("sp", "replicated"), default="sp")
    parser.add_argument(
        "--engram", choices=("auto", "replicated", "sharded", "host"), default="auto"
    )
    parser.add_argument(
        "--dump-dir", default=None,
        help="also write rank 0's graph.py and comm.json under DIR/rank0, as a compile's dump_dir "
        "option writes them (the header's options with their \"auto\" cuts decided)",
    )  # fmt: skip
    args = parser.parse_args()

    cfg = ModelConfig.from_name(args.preset)
    world = args.tp * args.dp
    ep = world if args.ep is None else args.ep
    options = {
        "tp": args.tp,
        "ep": ep,
        "ep_dispatch": args.ep_dispatch,
        "ep_rows": args.ep_rows,
        "attn_exit": args.attn_exit,
        "attn_entry": args.attn_entry,
        "layout": args.layout,
        "lowering": "eager",
        "embedding": args.embedding,
        "engram": args.engram,
    }
    start = time.perf_counter()
    gm, ctx, model = plan_rank(cfg, options, world_size=world, progress=f"planning {args.preset}")
    seconds = time.perf_counter() - start
    plan = ctx.plan  # with the options' "auto" cuts decided for this model
    print(
        f"{args.layout} plan for {args.preset}, tp={args.tp}, ep={ep} (unlisted parameters "
        f"are replicated; "
        f"E(0): experts sharded over the world; C / C(host): a table split by column over the "
        f"world, in device / host memory):"
    )
    for what, entries in (("parameter", plan.params), ("entering ", plan.anchors),
                          ("leaving  ", plan.exits)):  # fmt: skip
        for entry in entries:
            print(f"  {what} {entry.pattern:<32} {format_placement(entry.placement)}")
    print(f"  partial sums go to {format_placement(plan.partial_to)} before any use")
    for pattern in plan.entry_cuts:
        print(f"  the gather entering {pattern} moves to the cheapest cut (per layer, below)")
    labels, groups = graph_labels(ctx)

    counts = Counter(
        (n.meta[REGION] or "(entry)", collective_kind(n))
        for n in gm.graph.nodes
        if collective_kind(n)
    )
    print(
        f"\nplanned in {seconds:.1f} s; collectives per region ({len(gm.graph.nodes)} nodes in "
        f"the per-rank graph):"
    )
    for (region, kind), n in sorted(counts.items()):
        print(f"  {region:<16} {kind:<15} x{n}")
    print("\nchoices per layer (every layer where a pattern says layers.*):")
    for pattern, why in ctx.choices.items():
        print(f"  {pattern:<20} {why}")
    for info in ep_layers(ctx):
        print(f"  {info.region:<20} {info.why}")
    mode = model.plan[args.layer].mode
    print(f"\nlayer {args.layer} ({mode}) of the rewritten graph; T = the DP group's tokens:\n")
    print(format_graph(gm, labels=labels, groups=groups, region=f"layers.{args.layer}"))
    if args.dump_dir:
        text = graph_text(gm, ctx)
        out = write_dump(args.dump_dir, ctx.mesh, ctx.options, text, list(ctx.comm), ep_layers(ctx))
        lines = len((out / "graph.py").read_text().splitlines())
        print(f"\nwrote {out / 'graph.py'} ({lines} lines) and {out / 'comm.json'}")


if __name__ == "__main__":
    run(main)
