"""One rank of a fake world: the rewritten graph a rank compiles, without other processes.

`compile_model_on_fake_rank(model, args, options)` compiles a model of any registered family
with `dsv41_sp` as one rank of a `fake` process group (collectives move no data) and calls it
once: it returns that rank's rewritten graph, its compile context and the output (which means
nothing: no data moved). The rest reads such a graph: one region as snapshot text, the lines
around its collectives, its placements counted, its collectives per decoder layer. A family's
own helpers build on these (DeepSeek V4.1: `deepseek_v41.testing.fake_rank`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import GraphModule

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.meta import OUT, REGION
from dsv41_compile.core.placements import format_placement
from dsv41_compile.frontend.tokens import mark_token_dim
from dsv41_compile.report.dump import graph_labels
from dsv41_compile.report.graph_printer import format_graph
from dsv41_compile.testing.observe import capture_programs
from dsv41_compile.testing.torch_shims import fake_process_group

__all__ = [
    "collective_windows",
    "compile_model_on_fake_rank",
    "compiled_call",
    "layer_collectives",
    "layer_text",
    "placement_counts",
]


def compile_model_on_fake_rank(
    model: torch.nn.Module,
    args: Sequence[Any],
    options: dict[str, Any],
    *,
    rank: int = 1,
    world_size: int = 8,
    token_inputs: Sequence[torch.Tensor] = (),
) -> tuple[GraphModule, CompileContext, Any]:
    """Any model of a registered family (`families`) compiled with `dsv41_sp` as rank `rank` of a fake
    world and called once on `args`: its rewritten graph, its context and its output (which
    means nothing: no data moved). `token_inputs` are marked with `mark_token_dim`."""
    with capture_programs() as programs:
        out = compiled_call(model, args, options, rank, world_size, token_inputs)
    (gm, ctx), *_ = programs
    return gm, ctx, out


def compiled_call(
    model: torch.nn.Module,
    args: Sequence[Any],
    options: dict[str, Any],
    rank: int,
    world_size: int,
    token_inputs: Sequence[torch.Tensor],
) -> Any:
    """`compile_model_on_fake_rank`'s compile and call, nothing watching the pipeline (eager
    lowering unless `options` say otherwise): the output."""
    torch.compiler.reset()
    with fake_process_group(world_size=world_size, rank=rank):
        if token_inputs:
            mark_token_dim(*token_inputs)
        compiled = torch.compile(
            model, backend="dsv41_sp", options={"lowering": "eager", **options}, fullgraph=True
        )
        return compiled(*args)


def layer_text(gm: GraphModule, ctx: CompileContext, region: str) -> str:
    """One region of the graph (e.g. "layers.1.attn") as snapshot text: stable names."""
    labels, groups = graph_labels(ctx)
    return format_graph(gm, labels=labels, groups=groups, region=region, stable_names=True)


def collective_windows(text: str, context: int = 2) -> str:
    """The lines of a region's snapshot text (`layer_text`) around each collective: `context`
    lines either side, windows that overlap merged, `...` between them. What a snapshot pins
    of a block: where it talks, and what it hands over; `placement_counts` pins the rest."""
    lines = text.splitlines()
    keep: set[int] = set()
    for i, line in enumerate(lines):
        if "_c10d_functional." in line.split("#")[0] and "wait_tensor" not in line.split("#")[0]:
            keep.update(range(max(0, i - context), min(len(lines), i + context + 2)))
    out: list[str] = []
    for i in sorted(keep):
        if out and i - 1 not in keep:
            out.append("...")
        out.append(lines[i])
    return "\n".join(out)


def placement_counts(gm: GraphModule, region: str) -> dict[str, int]:
    """How many ops of `region` (and its submodules, as `layer_text` selects them) have each
    output placement, e.g. `{"R": 20, "S(0)": 31, "-": 12}` ("-": no tensor placement, as on
    the nodes a rewrite inserted after localize)."""
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        node_region = node.meta.get(REGION, "")
        if node.op != "call_function" or not (
            node_region == region or node_region.startswith(region + ".")
        ):
            continue
        out = node.meta.get(OUT)
        if isinstance(out, tuple):
            key = "(" + ", ".join(format_placement(p) for p in out) + ")"
        else:
            key = format_placement(out)
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def layer_collectives(comm: list[dict[str, Any]]) -> dict[int, list[str]]:
    """Per decoder layer, the sorted `kind(axis)` of its collectives (from `comm.json` records
    or a program's report)."""
    layers: dict[int, list[str]] = {}
    for record in comm:
        if record["layer"] is not None:
            layers.setdefault(record["layer"], []).append(f"{record['kind']}({record['axis']})")
    return {layer: sorted(kinds) for layer, kinds in sorted(layers.items())}
