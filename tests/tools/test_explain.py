"""tools/explain.py as docs/reference.md's table of tools runs it: the plan's table, the collectives
per region, the choices and one layer's rewritten graph; `--dump-dir` writes rank 0's dump."""

from __future__ import annotations

import json
import sys


def test_explain_prints_the_plan_the_choices_and_a_layers_graph(
    load_tool, monkeypatch, capsys, tmp_path
):
    tool = load_tool("explain")
    argv = ["explain.py", "--preset", "tiny-swa", "--tp", "4", "--ep", "1", "--layer", "0"]
    argv += ["--dump-dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    tool.main()
    out = capsys.readouterr().out
    for line in (
        "  parameter layers.*.attn.wq_b.weight        S(0)",
        "  parameter layers.*.attn.wo_b.weight        S(1)",
        "  entering  layers.*                         S(0)",
        "  entering  layers.*.attn                    R",
        "  partial sums go to S(0) before any use",
        "  layers.0         reduce_scatter  x1",
        "  layers.0.attn    all_gather      x1",
        "layer 0 (swa) of the rewritten graph; T = the DP group's tokens:",
    ):
        assert line in out.splitlines(), line
    assert "  layers.*             attn_exit='auto': reduce_scatter" in out
    graph = (tmp_path / "rank0" / "graph.py").read_text()
    assert f"wrote {tmp_path / 'rank0' / 'graph.py'} ({len(graph.splitlines())} lines)" in out
    assert graph.startswith('"""dsv41_sp per-rank graph: rank 0 (tp_rank 0 of TP group 0), tp=4')
    comm = json.loads((tmp_path / "rank0" / "comm.json").read_text())
    kinds = [(r["layer"], r["kind"]) for r in comm["collectives"]]
    assert (0, "reduce_scatter") in kinds and (0, "all_gather") in kinds, kinds
