"""The pass manager and the hooks on a three-node graph: order, predicates, timing, dumps
after a named pass, hooks, and an internal error that names the pass and keeps the graph."""

from __future__ import annotations

import operator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.fx import Graph, GraphModule

from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.hooks import Hooks, PipelineStopped, installed, pass_manager
from dsv41_compile.core.passes import Pass, PassManager


def small_graph() -> GraphModule:
    graph = Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(operator.add, (x, 1)))
    return GraphModule(torch.nn.Module(), graph)


def context(*dump_after: str) -> SimpleNamespace:
    return SimpleNamespace(options=SimpleNamespace(dump_after=dump_after), pass_seconds={})


class Written:
    """A graph writer that records what it was asked to write."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path, self.names = tmp_path, []

    def __call__(self, gm, ctx, name):
        self.names.append(name)
        path = self.tmp_path / f"{name}.py"
        path.write_text(gm.code)
        return path


def doubling(gm, *, ctx):
    (add,) = [n for n in gm.graph.nodes if n.target is operator.add]
    add.target = operator.mul
    gm.recompile()


def test_passes_run_in_order_when_enabled_timed_and_dumped_by_name(tmp_path):
    ran = []
    passes = [
        Pass("first", lambda gm, *, ctx: ran.append("first")),
        Pass("skipped", lambda gm, *, ctx: ran.append("skipped"), enabled=lambda ctx: False),
        Pass("double", doubling),
    ]
    written = Written(tmp_path)
    ctx = context("double")
    gm = small_graph()
    PassManager(passes, write_graph=written).run(gm, ctx)
    assert ran == ["first"]
    assert set(ctx.pass_seconds) == {"first", "double"}
    assert written.names == ["after_double"]
    assert "x * 1" in (tmp_path / "after_double.py").read_text()
    assert gm(torch.tensor(3.0)) == 3.0  # x * 1


def test_pass_names_are_unique():
    with pytest.raises(ValueError, match="pass names must be unique"):
        PassManager([Pass("a", doubling), Pass("a", doubling)], write_graph=Written(Path()))


def test_an_internal_error_names_the_pass_and_writes_the_graph_it_left(tmp_path):
    def broken(gm, *, ctx):
        doubling(gm, ctx=ctx)
        raise InternalError("the sum went missing")

    written = Written(tmp_path)
    with pytest.raises(InternalError) as info:
        PassManager([Pass("broken", broken)], write_graph=written).run(small_graph(), context())
    assert str(info.value) == (
        "dsv41_sp internal error in pass 'broken': the sum went missing. This is a bug in "
        f"dsv41_compile, not in your model; the graph the pass left is in "
        f"{tmp_path / 'failed_broken.py'} (attach it to the report)"
    )
    assert "x * 1" in (tmp_path / "failed_broken.py").read_text()


def test_an_assert_in_a_pass_is_an_internal_error_too(tmp_path):
    def asserting(gm, *, ctx):
        raise AssertionError("two outputs")

    with pytest.raises(InternalError, match="in pass 'asserting': two outputs"):
        PassManager([Pass("asserting", asserting)], write_graph=Written(tmp_path)).run(
            small_graph(), context()
        )


def test_hooks_see_every_pass_add_passes_and_stop_the_pipeline(tmp_path):
    seen, probes = [], []
    probe = Pass("probe", lambda gm, *, ctx: probes.append(len(gm.graph.nodes)))
    hooks = Hooks(after_pass=lambda name, gm, ctx: seen.append(name), extra_passes=(probe,))
    passes, written = [Pass("double", doubling)], Written(tmp_path)
    with installed(hooks):
        pass_manager(passes, write_graph=written).run(small_graph(), context())
    assert seen == ["double", "probe"]
    assert probes == [3]
    with installed(Hooks(stop_after="double")), pytest.raises(PipelineStopped):
        pass_manager(passes, write_graph=written).run(small_graph(), context())
    pass_manager(passes, write_graph=written).run(small_graph(), context())  # uninstalled
    assert seen == ["double", "probe"]
