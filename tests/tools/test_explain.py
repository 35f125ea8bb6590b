"""tools/explain.py as the README's table of tools runs it: the plan's table, the collectives
per region, the choices and one layer's rewritten graph."""

from __future__ import annotations

import sys


def test_explain_prints_the_plan_the_choices_and_a_layers_graph(load_tool, monkeypatch, capsys):
    tool = load_tool("explain")
    argv = ["explain.py", "--preset", "tiny-swa", "--tp", "4", "--ep", "1", "--layer", "0"]
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
