"""`dump_dir/rank{r}/graph.py` and `dump_dir/rank{r}/comm.json`, written at compile time."""

from __future__ import annotations

import json
from pathlib import Path

from torch.fx import GraphModule

from dsv41_compile.context import CompileContext
from dsv41_compile.testing.graph_printer import format_graph

__all__ = ["dump", "graph_labels"]


def graph_labels(ctx: CompileContext) -> tuple[dict[str, str], dict[str, str]]:
    """Placeholder labels (parameter FQNs, input names) and group-name -> axis-name map."""
    labels = dict(ctx.param_fqns)
    labels.update(ctx.input_sources)
    return labels, {ctx.mesh.tp_group_name: "tp"}


def dump(gm: GraphModule, ctx: CompileContext, dump_dir: str) -> Path:
    mesh = ctx.mesh
    out = Path(dump_dir) / f"rank{mesh.rank}"
    out.mkdir(parents=True, exist_ok=True)
    labels, groups = graph_labels(ctx)
    inputs = [
        f"#   {labels.get(n.name, n.name)}"
        + (f"  (local shard {ctx.param_shards[i][1]})" if i in ctx.param_shards else "")
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
                "collectives": ctx.comm,
            },
            indent=2,
        )  # fmt: skip
        + "\n"
    )
    return out
