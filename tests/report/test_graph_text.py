"""graph.py prints a decoder layer planned the same as an earlier one as one line that calls the
earlier one (`report.graph_printer.format_folded`): tiny-swa's three layers, layers 1 and 2 one
kind, sp, exact EP (their all-to-all sizes are each layer's own)."""

from __future__ import annotations

import re

import pytest
from torch.distributed.tensor import Replicate

from dsv41_compile.core.meta import OUT, REGION
from dsv41_compile.deepseek_v41.testing.presets import compile_config
from dsv41_compile.report.dump import graph_text, layer_module


@pytest.fixture(scope="module")
def planned(plan_once):
    """The plan tests/test_verify.py checks verify's propagation on (planned once): exact EP,
    whose sizes are data-dependent."""
    cfg = compile_config("tiny-swa", (("n_layers", 3),))
    options = {"tp": 4, "ep": 8, "ep_dispatch": "exact"}
    gm, ctx, _ = plan_once(cfg, options, world_size=8, rank=1)
    return gm, ctx


def _nodes_of(gm, ctx, layer: str):
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and layer_module(n.meta.get(REGION, ""), ctx) == layer
    ]


def test_a_layer_planned_like_an_earlier_one_is_one_call(planned):
    gm, ctx = planned
    text = graph_text(gm, ctx)
    layer1, layer2 = _nodes_of(gm, ctx, "layers.1"), _nodes_of(gm, ctx, "layers.2")
    assert len(layer1) == len(layer2) > 300
    printed = {line.split(" = ")[0] for line in text.splitlines() if " = " in line}
    assert all(n.name in printed for n in layer1)  # layer 1 in full
    assert not any(n.name in printed for n in layer2[1:])  # layer 2 not
    (header,) = [line for line in text.splitlines() if line.startswith("# layers.1, printed")]
    (call,) = [line for line in text.splitlines() if " = layers.1(" in line]
    assert "and layers.2 (the same plan" in header
    assert call.endswith("# layers.2: layers.1's plan, with data-dependent sizes of its own")
    takes = re.search(r"takes \((.*)\), makes \((.*)\)", header)
    made, taken = re.match(r"(.*) = layers\.1\((.*)\)  #", call).groups()
    # the same inputs in the same roles: layer 2's weights and cache where layer 1 has its own
    assert len(taken.split(", ")) == len(takes[1].split(", ")) > 20
    roles = [
        (re.sub(r"layers\.2\.", "layers.1.", a), b)
        for a, b in zip(taken.split(", "), takes[1].split(", "))
        if a.startswith("layers.")
    ]
    assert roles and all(a == b for a, b in roles)
    assert len(made.split(", ")) == len(takes[2].split(", "))
    assert "cache.window_kv[2]" in taken and "cache.window_kv[1]" in takes[1]


def test_a_layer_planned_differently_is_printed_in_full(planned):
    """One placement changed in layer 2 (as a faulty pass would): no longer layer 1's plan."""
    gm, ctx = planned
    node = next(n for n in _nodes_of(gm, ctx, "layers.2") if n.meta.get(OUT) is not None)
    kept = node.meta[OUT]
    node.meta[OUT] = Replicate() if kept != Replicate() else None
    try:
        text = graph_text(gm, ctx)
    finally:
        node.meta[OUT] = kept
    printed = {line.split(" = ")[0] for line in text.splitlines() if " = " in line}
    assert all(n.name in printed for n in _nodes_of(gm, ctx, "layers.2"))
    assert " = layers.1(" not in text
