"""A lowering is one registered `Target`: its name becomes a value of the `lowering` option, its
needs are checked by the options, its passes run in the pipeline and its compile gets the
per-rank graph -- with no edit to `options.py`, `backend.py` or `pipeline.py` (the toy model on
a fake rank)."""

from __future__ import annotations

import pytest
import torch

from dsv41_compile.core.passes import Pass
from dsv41_compile.options import LOWERINGS, BackendOptions, Lowering
from dsv41_compile.pipeline import pass_names
from dsv41_compile.targets import TARGETS, Target, register_target
from dsv41_compile.testing.fake_rank import compile_model_on_fake_rank
from dsv41_compile.testing.toy import ToyLM, toy_family


@pytest.fixture
def whole_graph_target():
    """A target that runs a graph as a whole on its device (here: the FX graph, counted)."""
    seen: dict[str, list] = {"passes": [], "compiles": [], "installed": []}

    def mark(gm, ctx):
        seen["passes"].append(ctx.target)

    def compile_(gm, handoff):
        seen["compiles"].append((handoff.target, handoff.rank))
        return gm.forward

    def missing():
        if not seen["installed"]:
            raise ValueError("lowering='my_graph' needs my_compiler: pip install my_compiler")

    target = Target(
        Lowering("my_graph", whole_graph="my device's graphs"),
        compile_,
        passes=(Pass("my_pass", mark),),
        available=missing,
    )
    register_target(target)
    try:
        yield seen
    finally:
        del TARGETS["my_graph"], LOWERINGS["my_graph"]


def test_a_registered_target_is_a_lowering_the_options_check(whole_graph_target):
    assert BackendOptions(lowering="my_graph").lowering == "my_graph"
    assert "my_pass" in pass_names()
    with pytest.raises(ValueError) as info:
        BackendOptions(lowering="my_graph", ep=8, ep_dispatch="exact")
    assert str(info.value) == (
        "lowering='my_graph' needs ep_dispatch='padded' with ep > 1: the exact EP lowering reads "
        "the assignment counts on the host (data-dependent sizes), which my device's graphs "
        "cannot run"
    )
    with pytest.raises(
        ValueError, match=r"choose one of \('auto', 'eager', 'inductor', 'my_graph'"
    ):
        BackendOptions(lowering="their_graph")


def test_a_registered_target_gets_its_passes_and_the_per_rank_graph(whole_graph_target):
    """Its availability is checked before anything compiles: missing, the compile stops with
    its message; present, its pass runs and its compile gets the per-rank graph."""
    options = {"tp": 2, "lowering": "my_graph"}
    with toy_family():
        with pytest.raises(Exception) as info:
            compile_model_on_fake_rank(ToyLM(), (torch.arange(8),), options)
        assert "lowering='my_graph' needs my_compiler: pip install my_compiler" in str(info.value)
        assert whole_graph_target["passes"] == whole_graph_target["compiles"] == []
        whole_graph_target["installed"].append(True)
        gm, ctx, out = compile_model_on_fake_rank(ToyLM(), (torch.arange(8),), options)
    assert whole_graph_target["passes"] == ["my_graph"]
    assert whole_graph_target["compiles"] == [("my_graph", 1)]
    assert ctx.target == "my_graph" and out.shape[0] == 8
