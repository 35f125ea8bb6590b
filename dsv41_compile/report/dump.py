"""What a compile writes for people: `dump_dir/rank{r}/graph.py` (the per-rank graph) and
`dump_dir/rank{r}/comm.json` (its collectives; with expert parallelism `ep_steps` grows by one
entry per call, `EpStepLog`), plus the graph after a named pass (`dump_after`) or after a pass
that broke an invariant (`write_graph`)."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule, Node

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.mesh import Mesh
from dsv41_compile.core.meta import REGION
from dsv41_compile.moe.stats import EpLayer
from dsv41_compile.report.comm import ExtraCollectives
from dsv41_compile.report.graph_printer import format_folded, format_graph

__all__ = [
    "EpStepLog",
    "graph_labels",
    "graph_text",
    "layer_module",
    "rank_dir",
    "write_dump",
    "write_graph",
]


def graph_labels(ctx: CompileContext) -> tuple[dict[str, str], dict[str, str]]:
    """Placeholder labels (parameter FQNs, input names) and group-name -> axis-name map."""
    labels = dict(ctx.param_fqns)
    labels.update(ctx.input_sources)
    groups = {ctx.mesh.tp_group_name: "tp"}
    if ctx.mesh.ep > 1:
        groups.setdefault(ctx.mesh.ep_group_name, "ep")
    return labels, groups


def graph_text(gm: GraphModule, ctx: CompileContext) -> str:
    """The graph as `graph.py` shows it: its inputs in order, then one line per node, a decoder
    layer planned the same as an earlier one as one line that calls it (`format_folded`). The
    same on every rank (the rank enters as the `tp_rank` input)."""
    labels, groups = graph_labels(ctx)
    shards = ctx.signature.param_shards
    inputs = [
        f"#   {labels.get(n.name, n.name)}"
        + (f"  (local shard {shards[i].placement})" if i in shards else "")
        for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")
    ]
    layer_modules: dict[str, str | None] = {}

    def unit_of(node: Node) -> str | None:
        region = node.meta.get(REGION, "")
        if region not in layer_modules:
            layer_modules[region] = layer_module(region, ctx)
        return layer_modules[region]

    body = format_folded(gm, labels=labels, groups=groups, unit_of=unit_of)
    head = "# inputs, in order:\n" + "\n".join(inputs) + "\n\n"
    extra = ctx.get(ExtraCollectives, ExtraCollectives(())).collectives
    if extra:
        promise = ctx.adapter.expected_collectives(ctx.options)
        head += (
            f"# collectives beyond the {ctx.options.layout} layout's (per decoder layer: "
            f"{list(promise.tp_outside_moe)} outside its MoE half, {list(promise.tp_in_moe)} in "
            "it), each with the op that needs it:\n"
            + "\n".join(f"#   {c.text()}" for c in extra)
            + "\n\n"
        )
    return head + body + "\n"


def layer_module(region: str, ctx: CompileContext) -> str | None:
    """The decoder layer's module a region sits in (`layers.3` for `layers.3.attn`): its
    shortest prefix in the same layer, by the adapter's `site`; None outside the layers."""
    layer = ctx.adapter.site(region).layer
    if layer is None:
        return None
    parts = region.split(".")
    prefixes = (".".join(parts[:n]) for n in range(1, len(parts) + 1))
    return next(p for p in prefixes if ctx.adapter.site(p).layer == layer)


def rank_dir(dump_dir: str | None, rank: int) -> Path:
    """`dump_dir/rank{r}`, or a new temporary folder when there is no dump_dir."""
    base = Path(dump_dir) if dump_dir is not None else Path(tempfile.mkdtemp(prefix="dsv41_sp_"))
    out = base / f"rank{rank}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_graph(gm: GraphModule, ctx: CompileContext, name: str) -> Path:
    """`name.py` in this rank's dump folder: the graph as it is now (during the pipeline)."""
    path = rank_dir(ctx.options.dump_dir, ctx.mesh.rank) / f"{name}.py"
    labels, groups = graph_labels(ctx)
    path.write_text(format_graph(gm, labels=labels, groups=groups) + "\n")
    return path


def write_dump(
    dump_dir: str,
    mesh: Mesh,
    options: object,
    text: str,
    comm: list[dict[str, Any]],
    ep_layers: list[EpLayer],
) -> Path:
    """`graph.py` and `comm.json` of this rank; returns its folder."""
    out = rank_dir(dump_dir, mesh.rank)
    header = (
        f'"""dsv41_sp per-rank graph: rank {mesh.rank} (tp_rank {mesh.tp_rank} of TP group '
        f"{mesh.dp_rank}), tp={mesh.tp}, world={mesh.world_size}, options={options}.\n\n"
        "Each line is one node: `name = op(args)  # placement dtype[local shape]`. Placements\n"
        "are on the tp axis: S(d) sharded on dim d, R replicated, P partial sum. T is the DP\n"
        "group's token count; Tl = (T + tp - 1) // tp rows per rank. Inserted collectives end in\n"
        "`<- why`: which consumer needed which placement. A decoder layer planned the same as\n"
        "an earlier one (the same ops, placements, local shapes and collectives) is one line,\n"
        "`outputs = layers.K(inputs)`: layer K's lines, printed once, run on this layer's inputs\n"
        '(its weights, its cache) in the order layer K\'s header lists them.\n"""\n\n'
    )
    (out / "graph.py").write_text(header + text)
    # each collective waits its latency: how many per layer
    per_layer = Counter(str(r["layer"]) for r in comm if r["layer"] is not None)
    (out / "comm.json").write_text(
        json.dumps(
            {
                "rank": mesh.rank,
                "tp_rank": mesh.tp_rank,
                "dp_rank": mesh.dp_rank,
                "tp": mesh.tp,
                "world_size": mesh.world_size,
                "ep": mesh.ep,
                "collectives": comm,
                "collectives_per_layer": dict(per_layer),
                "ep_layers": [dataclasses.asdict(layer) for layer in ep_layers],
                "ep_steps": [],
            },
            indent=2,
        )  # fmt: skip
        + "\n"
    )
    return out


class EpStepLog:
    """Appends each call's EP traffic to `comm.json`'s `ep_steps`: per MoE layer, the valid
    assignments this rank sent and received and the dispatch / combine bytes it sent
    (`EpLayer.step_record`). A debugging aid: it reads the counts on the host every call."""

    def __init__(self, path: Path, layers: list[EpLayer], rank: int) -> None:
        self.path, self.layers, self.rank = path, list(layers), rank

    def __call__(self, stats: list[torch.Tensor], ep_tokens: int) -> None:
        doc = json.loads(self.path.read_text())
        doc["ep_steps"].append(
            {
                "call": len(doc["ep_steps"]),
                "ep_tokens": ep_tokens,
                "layers": [
                    layer.step_record(s, ep_tokens, self.rank)
                    for layer, s in zip(self.layers, stats)
                ],
            }
        )
        self.path.write_text(json.dumps(doc, indent=2) + "\n")
