"""`dump_dir/rank{r}/graph.py` and `dump_dir/rank{r}/comm.json`, written at compile time; with
expert parallelism, `comm.json`'s `ep_steps` grows by one entry per call (`EpStepLog`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch.fx import GraphModule

from dsv41_compile.context import CompileContext
from dsv41_compile.testing.graph_printer import format_graph

__all__ = ["EpStepLog", "dump", "graph_labels"]


def graph_labels(ctx: CompileContext) -> tuple[dict[str, str], dict[str, str]]:
    """Placeholder labels (parameter FQNs, input names) and group-name -> axis-name map."""
    labels = dict(ctx.param_fqns)
    labels.update(ctx.input_sources)
    groups = {ctx.mesh.tp_group_name: "tp"}
    if ctx.mesh.ep > 1:
        groups.setdefault(ctx.mesh.ep_group_name, "ep")
    return labels, groups


def dump(gm: GraphModule, ctx: CompileContext, dump_dir: str) -> Path:
    mesh = ctx.mesh
    out = Path(dump_dir) / f"rank{mesh.rank}"
    out.mkdir(parents=True, exist_ok=True)
    labels, groups = graph_labels(ctx)
    inputs = [
        f"#   {labels.get(n.name, n.name)}"
        + (f"  (local shard {ctx.param_shards[i].placement})" if i in ctx.param_shards else "")
        for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")
    ]
    header = (
        f'"""dsv41_sp per-rank graph: rank {mesh.rank} (tp_rank {mesh.tp_rank} of TP group '
        f"{mesh.dp_rank}), tp={mesh.tp}, world={mesh.world_size}, options={ctx.options}.\n\n"
        "Each line is one node: `name = op(args)  # placement dtype[local shape]`. Placements\n"
        "are on the tp axis: S(d) sharded on dim d, R replicated, P partial sum. T is the DP\n"
        "group's token count; Tl = (T + tp - 1) // tp rows per rank. Inserted collectives end in\n"
        '`<- why`: which consumer needed which placement.\n"""\n'
    )
    body = format_graph(gm, labels=labels, groups=groups)
    text = header + "\n# inputs, in order:\n" + "\n".join(inputs) + "\n\n" + body + "\n"
    (out / "graph.py").write_text(text)
    (out / "comm.json").write_text(
        json.dumps(
            {
                "rank": mesh.rank,
                "tp_rank": mesh.tp_rank,
                "dp_rank": mesh.dp_rank,
                "tp": mesh.tp,
                "world_size": mesh.world_size,
                "ep": mesh.ep,
                "collectives": ctx.comm,
                "ep_layers": [dataclasses.asdict(layer) for layer in ctx.ep_layers],
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

    def __init__(self, path: Path, ctx: CompileContext) -> None:
        self.path, self.layers = path, list(ctx.ep_layers)

    def __call__(self, stats: list[torch.Tensor], ep_tokens: int) -> None:
        doc = json.loads(self.path.read_text())
        doc["ep_steps"].append(
            {
                "call": len(doc["ep_steps"]),
                "ep_tokens": ep_tokens,
                "layers": [layer.step_record(s, ep_tokens) for layer, s in zip(self.layers, stats)],
            }
        )
        self.path.write_text(json.dumps(doc, indent=2) + "\n")
