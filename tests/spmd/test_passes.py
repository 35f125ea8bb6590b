"""Each pass of the pipeline on a small graph: the toy family (`testing.toy`, two residual MLP
blocks, tp=4), stopped after the pass under test through the official hooks."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from dsv41_compile.core.collectives import collective_kind
from dsv41_compile.core.hooks import Hooks, PipelineStopped, installed
from dsv41_compile.core.meta import GLOBAL_VAL, IN, OUT, REGION
from dsv41_compile.testing.fake_rank import compile_model_on_fake_rank, layer_collectives
from dsv41_compile.testing.toy import ToyLM, toy_family

TOKENS = torch.tensor([3, 1, 4, 1, 5])


def graph_after(name: str, *, mark: bool = True, tokens: torch.Tensor = TOKENS):
    """The toy's graph as the pass `name` left it (the pipeline stops there)."""
    kept = []
    hooks = Hooks(after_pass=lambda p, gm, ctx: kept.append((gm, ctx)) if p == name else None)
    stop = Hooks(stop_after=name)
    with toy_family(), installed(hooks), installed(stop), pytest.raises(Exception) as info:
        compile_model_on_fake_rank(
            ToyLM(), (tokens,), {"tp": 4}, token_inputs=(tokens,) if mark else ()
        )
    error = info.value
    while getattr(error, "inner_exception", None) is not None:
        error = error.inner_exception
    assert isinstance(error, PipelineStopped), error
    ((gm, ctx),) = kept
    return gm, ctx


def calls(gm, op):
    return [n for n in gm.graph.nodes if n.target is op]


aten = torch.ops.aten


def test_token_sizes_reads_every_token_count_from_the_token_input():
    gm, ctx = graph_after("token_sizes", mark=False)
    sizes = calls(gm, aten.sym_size.int)
    assert sizes, "the toy reads T"
    assert {n.args[0].name for n in sizes} == {ctx.token_input}


def test_annotate_places_every_value_and_changes_no_node():
    gm, _ = graph_after("annotate")
    up, down, *_, head = calls(gm, aten.mm.default)
    assert up.meta[IN] == (Replicate(), Shard(1)) and up.meta[OUT] == Shard(1)
    assert down.meta[IN] == (Shard(1), Shard(0)) and down.meta[OUT] == Partial()
    assert head.meta[OUT] == Replicate()
    assert [n.meta[REGION] for n in (up, down)] == ["blocks.0.mlp", "blocks.0.mlp"]
    assert not [n for n in gm.graph.nodes if collective_kind(n)]


def test_insert_puts_a_transition_wherever_a_placement_changes():
    gm, _ = graph_after("insert")
    kinds = [collective_kind(n) for n in gm.graph.nodes if collective_kind(n)]
    # per block: the normed input gathered, the partial reduce-scattered; the head's input
    assert kinds == ["all_gather", "reduce_scatter"] * 2 + ["all_gather"]
    for node in gm.graph.nodes:  # every input now arrives as its consumer needs it
        if node.meta.get(IN) and node.op == "call_function":
            have = [a.meta[OUT] for a in node.all_input_nodes if a.meta.get(GLOBAL_VAL) is not None]
            assert [h for h in have if not isinstance(h, Partial)] == [
                n for h, n in zip(have, node.meta[IN]) if not isinstance(h, Partial)
            ], node.name


def test_localize_gives_parameter_shards_their_local_shape():
    gm, ctx = graph_after("localize")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    local = {
        ctx.param_fqns[placeholders[i].name]: shard.local_shape(
            list(placeholders[i].meta[GLOBAL_VAL].shape)
        )
        for i, shard in ctx.signature.param_shards.items()
    }
    assert local == {
        "blocks.0.mlp.up.weight": [8, 16],
        "blocks.0.mlp.down.weight": [16, 8],
        "blocks.1.mlp.up.weight": [8, 16],
        "blocks.1.mlp.down.weight": [16, 8],
    }


@pytest.mark.parametrize("tokens", [[3], [3, 1, 4, 1], [3, 1, 4, 1, 5, 9, 2, 6, 5]])
@pytest.mark.parametrize("mark", [True, False], ids=["marked", "static"])
def test_verify_accepts_the_same_layout_whatever_t_was_traced_with(tokens, mark):
    # T = 1, T = tp (a static T equal to tp must not be mistaken for it), T > 2 tp
    with toy_family():
        t = torch.tensor(tokens)
        _, ctx, logits = compile_model_on_fake_rank(
            ToyLM(), (t,), {"tp": 4}, token_inputs=(t,) if mark else ()
        )
    assert logits.shape == (len(tokens), 64)
    assert layer_collectives(ctx.comm) == {
        l: ["all_gather(tp)", "reduce_scatter(tp)"] for l in (0, 1)
    }


def test_a_size_read_is_refused_only_along_the_split_dim():
    """A head-sharded tensor's key count (a symbol when the cache's length is) is the same on
    every rank; its head count is not."""
    from torch.fx import Graph

    from dsv41_compile.spmd.annotate import _check_no_size_of_shard

    graph = Graph()
    x = graph.placeholder("x")
    x.meta["val"], x.meta[OUT] = torch.empty(5, 8, 12), Shard(1)
    keys = graph.call_function(aten.sym_size.int, (x, 2))
    _check_no_size_of_shard(keys, [x])
    for read in (
        graph.call_function(aten.sym_size.int, (x, -2)),
        graph.call_function(aten.sym_numel.default, (x,)),
    ):
        with pytest.raises(NotImplementedError, match="reads a size of a S\\(1\\) tensor"):
            _check_no_size_of_shard(read, [x])


def test_one_rank_removes_the_collectives_of_a_tp_group_of_one_rank():
    """tp=1 in a world of 4 (four DP groups of one rank): the plan still places the toy's MLPs
    on the TP axis and `insert` gathers and reduces over the group of one; `one_rank` removes
    each of those collectives, and the program, now with none, computes what the eager toy
    computes (a fake group moves no data, so only a program without collectives can be right
    on it)."""
    collectives = []

    def watch(name, gm, ctx):
        collectives.append((name, sorted(filter(None, map(collective_kind, gm.graph.nodes)))))

    model = ToyLM()
    with toy_family(), installed(Hooks(after_pass=watch)):
        gm, ctx, out = compile_model_on_fake_rank(
            model, (TOKENS,), {"tp": 1}, rank=2, world_size=4, token_inputs=(TOKENS,)
        )
    kinds = dict(collectives)
    assert "all_gather" in kinds["coalesce"] and "reduce_scatter" in kinds["coalesce"]
    assert kinds["one_rank"] == [] and ctx.comm == []
    torch.testing.assert_close(out, model(TOKENS))
