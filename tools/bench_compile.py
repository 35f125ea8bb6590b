"""Compile time of the dsv41_sp pipeline against layer count (one process, fake process group).

For window-only `tiny-swa` models of 1, 2, 4 and 8 layers and the 8-layer `tiny` (every
attention mode), times the first call of the compiled model (Dynamo + AOT + our passes + the
eager lowering) and the share spent in our passes, side by side in one run.

`--dspark-planning` times the planning of flash-dspark's drafter, verify and plain programs.
`--flash-planning` instead times `planning.plan_rank` (meta tensors, compile only) on the
first 5, 10, 20 and all 40 layers of `flash` (tp=4, ep=8, the EP lowering `--ep-dispatch`):
the cost of planning at real size, split into Dynamo (until the backend starts; it traces each
layer kind once, but still walks every layer), the layer kinds the backend traces to ATen once
each (how many, and their seconds), AOTAutograd's trace of the model with each kind's calls as
one operator, the kinds copied in at every layer (`inline`), and each of our passes (which
plan every layer); and the peak memory of the process
(`ru_maxrss`, which only grows: the last row's is the run's peak). The last line says how the
40-layer plan grew over the 5-layer one, stage by stage: a longer prefix meets layer kinds a
shorter one does not (each traced once), and the other stages still grow with the layers.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch._dynamo

import dsv41_compile
from dsv41_compile.core.hooks import Hooks, installed
from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig
from dsv41_compile.deepseek_v41.testing.batches import Request, pack
from dsv41_compile.pipeline import pass_names
from dsv41_compile.report.cli import run, tool_parser
from dsv41_compile.report.provenance import provenance
from dsv41_compile.testing.torch_shims import fake_process_group


@contextmanager
def timed_pipeline() -> Iterator[dict[str, float]]:
    """Within the context, the yielded dict sums the pipeline's `seconds` (`ctx.pass_seconds`,
    per pass in `passes`) over the graphs compiled and keeps the last graph's `nodes` (also
    when planning stops the pipeline), read through the backend's hooks."""
    record: dict = {"seconds": 0.0, "nodes": 0, "passes": {}, "stages": {}, "kinds": 0}

    def after(name, gm, ctx):
        if name == pass_names()[-1]:
            record["seconds"] += sum(ctx.pass_seconds.values())
            record["nodes"] = len(gm.graph.nodes)
            for p, seconds in ctx.pass_seconds.items():
                record["passes"][p] = record["passes"].get(p, 0.0) + seconds
            for stage, seconds in ctx.stage_seconds.items():
                record["stages"][stage] = record["stages"].get(stage, 0.0) + seconds
            record["kinds"] += ctx.kinds_traced

    with installed(Hooks(after_pass=after)):
        yield record


def compile_once(cfg: ModelConfig, tp: int, lowering: str) -> tuple[float, float, int]:
    torch.manual_seed(0)
    model = DeepseekV41(cfg)
    torch._dynamo.reset()
    with timed_pipeline() as pipeline:
        ids, positions, slots = pack([Request(0, [1, 2, 3], 0), Request(1, [4, 5], 0)])
        dsv41_compile.mark_token_dim(ids, positions, slots)
        options = {"tp": tp, "lowering": lowering}
        compiled = torch.compile(model, backend="dsv41_sp", options=options, fullgraph=True)
        start = time.perf_counter()
        compiled(ids, positions, slots, model.new_cache(2, 16))
        total = time.perf_counter() - start
    return total, pipeline["seconds"], int(pipeline["nodes"])


def flash_prefix(n_layers: int) -> ModelConfig:
    """The first `n_layers` layers of flash: sources and the candidate layer beyond them go."""
    cfg = ModelConfig.from_name("flash")
    candidate = cfg.candidate_source_layer_id
    return cfg.replace(
        n_layers=n_layers,
        compress_ratios=cfg.ratios[:n_layers],
        kv_source_layer_ids=tuple(i for i in cfg.kv_source_layer_ids if i < n_layers),
        index_source_layer_ids=tuple(i for i in cfg.index_source_layer_ids if i < n_layers),
        candidate_source_layer_id=candidate if candidate < n_layers else -1,
    )


def flash_planning(ep_dispatch: str) -> None:
    from dsv41_compile.planning import plan_rank

    passes = [p for p in pass_names() if p != "graph_mode"]
    print(f"flash, tp=4, ep=8, ep_dispatch={ep_dispatch!r}")
    print(
        f"{'flash layers':>12} {'nodes':>7} {'plan s':>7} {'s/layer':>8} {'dynamo':>7} "
        f"{'kinds':>5} {'kinds s':>7} {'aot':>6} {'passes':>7}  "
        + " ".join(f"{p:>9}" for p in passes)
        + f" {'peak GiB':>9}"
    )
    rows = {}
    for layers in (5, 10, 20, 40):
        options = {"tp": 4, "ep": 8, "ep_dispatch": ep_dispatch}
        with timed_pipeline() as pipeline:
            start = time.perf_counter()
            gm, _, _ = plan_rank(flash_prefix(layers), options, world_size=8)
            total = time.perf_counter() - start
        stages = pipeline["stages"]
        kinds_s, aot = stages.get("kinds", 0.0), stages.get("aot", 0.0)
        # The rest of the call before the backend's stages is Dynamo (and model building).
        dynamo = total - pipeline["seconds"] - sum(stages.values())
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        rows[layers] = {"total": total, "dynamo": dynamo, "kinds s": kinds_s, "aot": aot,
                        "passes": pipeline["seconds"], "kinds": pipeline["kinds"]}  # fmt: skip
        print(
            f"{layers:>12} {len(gm.graph.nodes):>7} {total:>7.1f} {total / layers:>8.2f} "
            f"{dynamo:>7.1f} {pipeline['kinds']:>5} {kinds_s:>7.1f} {aot:>6.1f} "
            f"{pipeline['seconds']:>7.1f}  "
            + " ".join(f"{pipeline['passes'].get(p, 0.0):>9.1f}" for p in passes)
            + f" {peak:>9.1f}"
        )
    short, long = rows[5], rows[40]
    growth = ", ".join(
        f"{stage} {long[stage] - short[stage]:+.1f} s"
        for stage in ("dynamo", "kinds s", "aot", "passes")
    )
    print(
        f"40 layers / 5 layers: {long['total'] / short['total']:.2f}x "
        f"({long['total'] - short['total']:+.1f} s: {growth}; "
        f"layer kinds traced {short['kinds']} -> {long['kinds']})"
    )


def dspark_planning(ep_dispatch: str) -> None:
    """flash-dspark's three programs planned one after the other: the backbone's plain call,
    the verify call (`hidden=True`) and the drafter (`model.mtp`)."""
    from dsv41_compile.planning import plan_rank

    cfg = ModelConfig.from_name("flash-dspark")
    options = {"tp": 4, "ep": 8, "ep_dispatch": ep_dispatch}
    print(f"flash-dspark, tp=4, ep=8, ep_dispatch={ep_dispatch!r}")
    print(f"{'program':>9} {'nodes':>7} {'plan s':>7} {'dynamo':>7} {'passes':>7} {'peak GiB':>9}")
    for program in ("drafter", "verify", "backbone"):
        with timed_pipeline() as pipeline:
            start = time.perf_counter()
            gm, _, _ = plan_rank(cfg, options, world_size=8, program=program)
            total = time.perf_counter() - start
        dynamo = total - pipeline["seconds"] - sum(pipeline["stages"].values())
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(
            f"{program:>9} {len(gm.graph.nodes):>7} {total:>7.1f} {dynamo:>7.1f} "
            f"{pipeline['seconds']:>7.1f} {peak:>9.1f}"
        )


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--lowering", choices=("eager", "inductor"), default="eager")
    parser.add_argument("--flash-planning", action="store_true", help="time flash planning")
    parser.add_argument(
        "--dspark-planning", action="store_true",
        help="time the planning of flash-dspark's drafter, verify and backbone programs",
    )  # fmt: skip
    parser.add_argument(
        "--ep-dispatch", choices=("exact", "padded"), default="exact",
        help="the EP lowering flash is planned with (padded: torchair's graph mode)",
    )  # fmt: skip
    args = parser.parse_args()
    print(provenance(), flush=True)  # the docs/benchmarks.md block's header
    if args.flash_planning:
        flash_planning(args.ep_dispatch)
        return
    if args.dspark_planning:
        dspark_planning(args.ep_dispatch)
        return
    rows = [("tiny-swa", n) for n in (1, 2, 4, 8)] + [("tiny", 8)]
    print(
        f"{'preset':<10} {'layers':>6} {'nodes':>6} {'compile s':>10} {'s/layer':>8} {'passes s':>9}"
    )
    with fake_process_group(world_size=2 * args.tp):
        for preset, layers in rows:
            cfg = ModelConfig.from_name(preset)
            if preset == "tiny-swa":
                cfg = cfg.replace(n_layers=layers)
            total, in_passes, nodes = compile_once(cfg, args.tp, args.lowering)
            print(
                f"{preset:<10} {layers:>6} {nodes:>6} {total:>10.1f} {total / layers:>8.2f} "
                f"{in_passes:>9.1f}"
            )


if __name__ == "__main__":
    run(main)
