"""Print the sharding plan and the rewritten per-rank graph of a preset for a given tp.

Runs in one process on a fake process group (no communication, no second process): the graph
is the one every rank compiles; only the `tp_rank` input differs between ranks.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
import torch._dynamo

import dsv41_compile
from dsv41_compile.dump import graph_labels
from dsv41_compile.fx_utils import REGION
from dsv41_compile.mesh import clear_mesh_cache
from dsv41_compile.model import DeepseekV41, ModelConfig
from dsv41_compile.propagation.dtensor_adapter import format_placement
from dsv41_compile.propagation.plan import deepseek_v41_plan
from dsv41_compile.testing.batches import Request, pack
from dsv41_compile.testing.capture import capture_programs, stop_after_pipeline
from dsv41_compile.testing.graph_printer import format_graph
from dsv41_compile.testing.torch_shims import fake_process_group
from dsv41_compile.validate import collective_kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=None, help="1 or the world size (default)")
    parser.add_argument("--ep-dispatch", choices=("exact", "padded"), default="exact")
    parser.add_argument("--layer", type=int, default=1, help="decoder layer to print in full")
    parser.add_argument(
        "--embedding", choices=("replicated", "vocab_sharded"), default="replicated"
    )
    args = parser.parse_args()

    cfg = ModelConfig.from_name(args.preset)
    world = args.tp * args.dp
    ep = world if args.ep is None else args.ep
    plan = deepseek_v41_plan(embedding=args.embedding, ep=ep)
    print(
        f"plan for {args.preset}, tp={args.tp}, ep={ep} (unlisted parameters are replicated; "
        f"E(0): experts sharded over the world):"
    )
    for pattern, placement in plan.params:
        print(f"  parameter {pattern:<32} {format_placement(placement)}")
    for pattern, placement in plan.anchors:
        print(f"  entering  {pattern:<32} {format_placement(placement)}")

    torch.manual_seed(0)
    model = DeepseekV41(cfg)
    ids, positions, slots = pack([Request(0, [1, 2, 3], 0), Request(1, [4, 5], 0)])
    dsv41_compile.mark_token_dim(ids, positions, slots)
    options = {
        "tp": args.tp,
        "ep": ep,
        "ep_dispatch": args.ep_dispatch,
        "lowering": "eager",
        "embedding": args.embedding,
    }
    with fake_process_group(world_size=world), capture_programs() as programs:
        clear_mesh_cache()
        compiled = torch.compile(model, backend="dsv41_sp", options=options, fullgraph=True)
        with stop_after_pipeline():  # compile only: the fake group's collectives move no data
            try:
                compiled(ids, positions, slots, model.new_cache(2, 16))
            except Exception:
                if not programs:
                    raise
        (gm, ctx), *_ = programs
        labels, groups = graph_labels(ctx)
    clear_mesh_cache()

    counts = Counter(
        (n.meta[REGION] or "(entry)", collective_kind(n))
        for n in gm.graph.nodes
        if collective_kind(n)
    )
    print(f"\ncollectives per region ({len(gm.graph.nodes)} nodes in the per-rank graph):")
    for (region, kind), n in sorted(counts.items()):
        print(f"  {region:<16} {kind:<15} x{n}")
    mode = model.plan[args.layer].mode
    print(f"\nlayer {args.layer} ({mode}) of the rewritten graph; T = the DP group's tokens:\n")
    print(format_graph(gm, labels=labels, groups=groups, region=f"layers.{args.layer}"))


if __name__ == "__main__":
    main()
