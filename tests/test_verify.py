"""verify has teeth: each bug class hand-written SP keeps shipping, seeded into a real rewritten
graph (tiny-swa's two window-only layers, `deepseek_v41.testing.presets.compile_config()`; rank 2 of a fake
world, sp, tp=4, ep=8 padded: the graph tests/moe/test_expert_parallel.py compiles), is
refused with an internal error naming the node and the broken invariant. The bug classes are the layout's, not an attention mode's (the seeds sit at layer 1's
boundary collectives, its EP dispatch, its positions); verify accepts the valid graphs of every
attention mode in every compile of the every-mode model (tests/distributed/test_numerics.py).

A seed edits a copy of the graph the way a faulty pass would, placements included (a faulty
rule that says what it produced); verify then runs on it as the pipeline runs it."""

from __future__ import annotations

import dataclasses
import re
from unittest import mock

import pytest
import torch
from torch._dispatch.python import enable_python_dispatcher
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dsv41_compile.core.collectives import collective_kind
from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.fake_prop import _OnceProp
from dsv41_compile.core.meta import EP_SOURCE, IN, OUT, REASON, REGION
from dsv41_compile.deepseek_v41.testing.fake_rank import compile_on_fake_rank
from dsv41_compile.deepseek_v41.testing.presets import compile_config
from dsv41_compile.testing.fake_rank import layer_collectives
from dsv41_compile.verify import verify

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
OPTIONS = {"tp": 4, "ep": 8, "ep_dispatch": "padded", "attn_exit": "reduce_scatter"}  # the seed


@pytest.fixture(scope="module")
def rewritten():
    gm, ctx, _ = compile_on_fake_rank(2, OPTIONS, compile_config())
    return gm, ctx


def copied(gm: GraphModule) -> GraphModule:
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return GraphModule(gm, graph)


def seeded(rewritten, seed) -> str:
    """The error verify raises on a copy of the rewritten graph with `seed` applied."""
    gm, ctx = rewritten
    bad = copied(gm)
    seed(bad)
    bad.recompile()
    with pytest.raises(InternalError) as info:
        verify(bad, ctx=dataclasses.replace(ctx, comm=[]))
    return str(info.value)


def layer1(gm: GraphModule, kind: str) -> Node:
    """Layer 1's attention-boundary collective of `kind`."""
    return next(
        n for n in gm.graph.nodes
        if collective_kind(n) == kind and n.meta[REGION].startswith("layers.1")
    )  # fmt: skip


def partial_of(gm: GraphModule) -> tuple[Node, Node]:
    """Layer 1's reduce-scatter and the wo_b partial sum it reduces (through the padding)."""
    scatter = layer1(gm, "reduce_scatter")
    pad = scatter.args[0]
    return scatter, pad.args[0]


def gathered_input(gm: GraphModule) -> Node:
    """Layer 1's all-gathered attention input: `getitem(split(wait(all_gather)), 0)`."""
    wait = next(iter(layer1(gm, "all_gather").users))
    split = next(iter(wait.users))
    return next(u for u in split.users if u.args[1] == 0)


def add(gm: GraphModule, before: Node, target, args, out, **kwargs) -> Node:
    """A node a faulty pass inserts: placed `out`, valued like its first argument (verify
    checks placements before it computes any value)."""
    with gm.graph.inserting_before(before):
        node = gm.graph.call_function(target, args, kwargs)
    node.meta.update({OUT: out, REGION: before.meta.get(REGION, ""), "val": args[0].meta["val"]})
    return node


def test_valid_graph_passes_and_its_collectives_are_recorded(rewritten):
    """The control of the seeded bugs below: the untouched copy passes, every node gets its
    local value again, and the records are the seed layout's, per layer."""
    gm, ctx = rewritten
    copy, fresh = copied(gm), dataclasses.replace(ctx, comm=[])
    valued = [n for n in copy.graph.nodes if n.op == "call_function" and "val" in n.meta]
    for node in valued:
        del node.meta["val"]
    verify(copy, ctx=fresh)
    assert len(valued) > 900 and all("val" in n.meta for n in valued)
    ep = ["all_to_all(ep)"] * 2  # padded dispatch: rows with routes, combine (sorted by kind)
    assert layer_collectives(fresh.comm) == {
        layer: ["all_gather(tp)", *ep, "reduce_scatter(tp)"] for layer in (0, 1)
    }


def test_a_partial_used_before_its_reduction(rewritten):
    def seed(gm):  # a rule that lets relu pass a partial sum through: relu(P) -> P
        scatter, partial = partial_of(gm)
        pad = scatter.args[0]
        relu = add(gm, pad, aten.relu.default, (partial,), Partial())
        relu.meta[IN] = (Partial(),)
        pad.args = (relu, *pad.args[1:])

    message = seeded(rewritten, seed)
    assert "at node relu" in message
    assert "uses the partial sum mm_" in message and "before its reduction" in message


def test_a_partial_scattered_without_its_reduction(rewritten):
    def seed(gm):  # P -> S(0) taken as a local slice (the R -> S transition) instead of a RS
        scatter, partial = partial_of(gm)
        pad = scatter.args[0]
        wait = next(iter(scatter.users))
        sizes = gm.graph.find_nodes(op="placeholder", target="tp_rank")[0]
        tl = next(n for n in gm.graph.nodes if n.meta.get(REASON) == "Tl = ceil(T/tp)")
        split = add(gm, wait, aten.unflatten.int, (pad, 0, [4, tl]), None)
        local = add(gm, wait, aten.index.Tensor, (split, [sizes]), Shard(0))
        wait.replace_all_uses_with(local)

    message = seeded(rewritten, seed)
    assert "slices the partial sum mm_" in message and "without reducing it" in message


def test_a_sum_over_replicated_copies(rewritten):
    def seed(gm):  # the reduce-scatter fed the replicated attention input: x tp
        scatter, _ = partial_of(gm)
        pad = scatter.args[0]
        pad.args = (gathered_input(gm), *pad.args[1:])

    message = seeded(rewritten, seed)
    assert "a reduce_scatter sums getitem" in message
    assert "is R, not a partial sum" in message and "tp times the value" in message
    assert "reduce_scatter_tensor" in message  # the node


def test_the_ep_dispatch_of_duplicated_tp_replicas(rewritten):
    def seed(gm):  # the MoE's token rows taken whole (R) on every TP rank: 4 x 96 assignments
        rows = next(
            n for n in gm.graph.nodes
            if n.meta.get(EP_SOURCE) and n.target is aten.index_select.default
            and n.meta[REGION].startswith("layers.1")
        )  # fmt: skip
        rows.args = (gathered_input(gm), *rows.args[1:])

    message = seeded(rewritten, seed)
    assert "the EP dispatch sends getitem" in message and "which is R" in message
    assert "tp times the assignments" in message


def test_a_collective_no_op_asked_for(rewritten):
    def seed(gm):  # the [Tl, 4, D] residual streams gathered at layer 1's entry, for nothing
        gather = layer1(gm, "all_gather")
        residual = next(
            n for n in gm.graph.nodes
            if n.meta.get(OUT) == Shard(0) and n.meta[REGION] == "layers.1"
            and n.meta["val"].dim() == 3
        )  # fmt: skip
        streams = add(gm, gather, c10d.all_gather_into_tensor.default,
                      (residual, 4, gather.args[2]), None)  # fmt: skip
        add(gm, gather, c10d.wait_tensor.default, (streams,), Replicate())

    message = seeded(rewritten, seed)
    assert "a collective no op asked for (all_gather: it has no reason)" in message
    assert "all_gather_into_tensor" in message


def test_a_reduce_scatter_of_a_rounded_partial(rewritten):
    def seed(gm):  # the partial cast to bf16 before the reduce-scatter
        scatter, partial = partial_of(gm)
        pad = scatter.args[0]
        cast = add(gm, pad, aten._to_copy.default, (partial,), Partial(), dtype=torch.bfloat16)
        pad.args = (cast, *pad.args[1:])

    message = seeded(rewritten, seed)
    assert "a reduce_scatter reduces torch.bfloat16" in message
    assert "fp32 partial sum the model computed" in message


def test_local_positions_paired_with_the_gathered_hidden(rewritten):
    def seed(gm):  # layer 1's rope reads this rank's shard of the positions
        _, ctx = rewritten
        positions = next(n for n in gm.graph.nodes if ctx.input_sources.get(n.name) == "positions")
        user = next(
            u for u in positions.users
            if u.meta.get(REGION) == "layers.1.attn" and u.meta.get(IN)
        )  # fmt: skip
        tp_rank = gm.graph.find_nodes(op="placeholder", target="tp_rank")[0]
        tl = next(n for n in gm.graph.nodes if n.meta.get(REASON) == "Tl = ceil(T/tp)")
        pad = next(n for n in gm.graph.nodes if n.meta.get(REASON) == "tp*Tl - T")
        padded = add(gm, user, aten.constant_pad_nd.default, (positions, [0, pad], 0), None)
        split = add(gm, user, aten.unflatten.int, (padded, 0, [4, tl]), None)
        local = add(gm, user, aten.index.Tensor, (split, [tp_rank]), Shard(0))
        user.args = tuple(local if a is positions else a for a in user.args)

    message = seeded(rewritten, seed)
    assert "needs index_tensor" in message and "as R but gets S(0)" in message
    assert "the token order would not match" in message


def test_an_internal_error_names_the_pass_and_writes_the_graph(rewritten, tmp_path):
    """Through the pass manager (what the backend runs), the error names the pass and writes
    the graph it left."""
    from dsv41_compile.core.passes import Pass, PassManager
    from dsv41_compile.report.dump import write_graph

    gm, ctx = rewritten
    bad = copied(gm)
    scatter, _ = partial_of(bad)
    scatter.args[0].args = (gathered_input(bad), *scatter.args[0].args[1:])
    options = dataclasses.replace(ctx.options, dump_dir=str(tmp_path))
    manager = PassManager([Pass("verify", verify)], write_graph=write_graph)
    with pytest.raises(InternalError) as info:
        manager.run(bad, dataclasses.replace(ctx, comm=[], options=options))
    path = tmp_path / "rank2" / "failed_verify.py"
    assert str(info.value).startswith("dsv41_sp internal error in pass 'verify' at node ")
    assert str(info.value).endswith(
        f"This is a bug in dsv41_compile, not in your model; the graph the pass left is in "
        f"{path} (attach it to the report)"
    )
    assert "reduce_scatter_tensor" in path.read_text()


def _propagated(gm: GraphModule, ctx, prop: type[FakeTensorProp]) -> tuple[list[str], int]:
    """Every node's value as `prop` propagates the per-rank graph (data-dependent sizes named
    by first appearance), and how many operators it ran."""
    ran = 0
    run = torch.fx.Interpreter.call_function

    def counted(self, target, args, kwargs):
        nonlocal ran
        ran += 1
        return run(self, target, args, kwargs)

    with (
        mock.patch.object(torch.fx.Interpreter, "call_function", counted),
        enable_python_dispatcher(),
    ):
        prop(gm, mode=ctx.fake_mode).propagate_dont_convert_inputs(*ctx.local_inputs(gm))
    names: dict[str, str] = {}
    values = [
        re.sub(r"\bu\d+\b", lambda m: names.setdefault(m.group(0), f"u{len(names)}"), text)
        for text in (_value_text(n.meta.get("val")) for n in gm.graph.nodes)
    ]
    return values, ran


def _value_text(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{list(value.shape)}{list(value.stride())}@{value.storage_offset()}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_value_text(v) for v in value) + ")"
    return str(value)


def test_verify_propagates_each_layer_kind_once(plan_once):
    """verify's fake propagation runs an operator once per distinct input metadata: tiny-swa's
    layers 1 and 2 (one kind), exact EP, whose all-to-all sizes are data-dependent -- every
    node's value is what propagating every node gives, each MoE layer keeps its own unbacked
    sizes (a `.item()` of layer 2 is not layer 1's), and fewer operators ran."""
    cfg = compile_config("tiny-swa", (("n_layers", 3),))
    options = {"tp": 4, "ep": 8, "ep_dispatch": "exact"}
    gm, ctx, _ = plan_once(cfg, options, world_size=8, rank=1)  # graph.py's plan too
    once, ran_once = _propagated(gm, ctx, _OnceProp)
    every, ran_every = _propagated(gm, ctx, FakeTensorProp)
    assert once == every
    assert (
        sum(bool(re.search(r"\bu\d+\b", v)) for v in every) > 50
    )  # the exact lowering's sizes are in the check
    assert ran_once < 0.8 * ran_every
