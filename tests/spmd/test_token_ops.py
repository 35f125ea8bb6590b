"""Each kind of op along the token dim (`spmd.token_ops`, `spmd.token_shifts`) on a small graph:
the toy family (`testing.toy`) with one op mixing the tokens of block 1's residual, where the
tokens are sharded, compiled as rank 1 of a fake world of 4 (one process, no data moves) with
T = 7 (uneven shards, a padding row on the last rank). Per kind: the placements the rules give
the op (after `token_shifts`, the pass that rewrites shifts) and the collectives the rewritten
graph has for it beyond the toy's layout, each with its reason; graph.py's list of them; and
verify refusing a statistic whose padding rows were left unmasked. The same ops on real ranks,
values compared with one device: tests/distributed/test_edits.py.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Graph, GraphModule

from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.hooks import Hooks, installed
from dsv41_compile.core.meta import IN, OUT, REAL_ROWS, RULE
from dsv41_compile.report.dump import graph_text
from dsv41_compile.spmd.token_dims import shift_tokens
from dsv41_compile.testing.fake_rank import compile_model_on_fake_rank
from dsv41_compile.testing.toy import ToyLM, toy_family
from dsv41_compile.verify import verify

aten = torch.ops.aten
R, S0 = Replicate(), Shard(0)
TOKENS = torch.tensor([3, 1, 4, 1, 5, 9, 2])
LAYOUT = [("all_gather", " in blocks.1.mlp needs "), ("reduce_scatter", "P -> S(0): ")]


def compiled(mix, *, in_mlp: bool = False):
    """The toy with `h + mix(h)` as block 1's residual (or its MLP's input `x -> mix(x)`,
    replicated, with `in_mlp`), compiled with the token count marked: the placements of the
    nodes of this file's lines after `token_shifts` (name -> (op, IN, OUT, rule)), the
    collectives of block 1 beyond the layout's ((kind, reason)), and the final graph."""
    model = ToyLM()
    module = model.blocks[1].mlp if in_mlp else model.blocks[1]
    base = type(module)
    if in_mlp:

        def forward(self, x):
            return base.forward(self, mix(x))
    else:

        def forward(self, h):
            return base.forward(self, h + mix(h))

    module.__class__ = type(base.__name__, (base,), {"forward": forward})
    placed = {}

    def keep(name, gm, ctx):
        if name == "token_shifts":
            for n in gm.graph.nodes:  # the nodes of `mix`: its line is the innermost
                frames = [f for f in n.meta.get("stack_trace", "").splitlines() if "File " in f]
                if n.op == "call_function" and frames and __file__ in frames[-1]:
                    placed[n.name] = (n.target, n.meta[IN], n.meta[OUT], n.meta.get(RULE, ""))

    with toy_family(), installed(Hooks(after_pass=keep)):
        gm, ctx, _ = compile_model_on_fake_rank(
            model, (TOKENS,), {"tp": 4}, world_size=4, token_inputs=(TOKENS,)
        )
    block = [(r["kind"], r["reason"]) for r in ctx.comm if r["layer"] == 1]
    for kind, why in LAYOUT:  # the toy's own: the MLP's input gathered, its output scattered
        block.remove(next(c for c in block if c[0] == kind and why in c[1]))
    compiled.ctx = ctx  # the last compile's context, for the dump's test
    return placed, block, gm


def nodes_of(placed, op):
    return [(p[1], p[2], p[3]) for p in placed.values() if p[0] is op]


@pytest.mark.parametrize(
    ("mix", "op", "out", "reduced"),
    [
        (lambda h: h.sum(0), aten.sum.dim_IntList, Partial(), "sum"),
        (lambda h: h.amax(0), aten.amax.default, Partial("max"), "max"),
        (lambda h: h.amin(0), aten.amin.default, Partial("min"), "min"),
        (lambda h: h.mean(0), aten.mean.dim, Partial(), "sum"),
    ],
    ids=["sum", "amax", "amin", "mean"],
)
def test_a_statistic_over_the_tokens_is_a_partial_of_the_real_rows_all_reduced(
    mix, op, out, reduced
):
    placed, block, gm = compiled(mix)
    ((given, made, rule),) = nodes_of(placed, op)
    assert (given, made) == ((S0,), out), rule
    ((kind, why),) = block
    assert kind == "all_reduce" and why.startswith(f"{out_text(out)} -> R: "), why
    # the reduction reads this rank's real rows, its padding rows its identity (the norms'
    # reductions, along the features, read no padding row of another)
    (masked,) = [
        n.args[0]
        for n in gm.graph.nodes
        if n.target in (op, aten.sum.dim_IntList) and n.args[0].meta.get(REAL_ROWS)
    ]
    identity = {"sum": 0, "max": float("-inf"), "min": float("inf")}[reduced]
    assert masked.target is aten.where.ScalarOther and masked.args[2] == identity


def _keys(h):
    """A key per token (two "requests"), made from the token's own row: a token shard."""
    return (h[:, 0] > 0).long()


def _keys_2d(h):
    return _keys(h)[:, None].expand_as(h)


@pytest.mark.parametrize(
    ("mix", "op", "start", "out"),
    [
        (
            lambda h: h.new_zeros(2, h.shape[1]).index_add(0, _keys(h), h)[_keys(h)],
            aten.index_add.default, Partial(), Partial(),
        ),
        (
            lambda h: h.new_zeros(2, h.shape[1]).scatter_add(0, _keys_2d(h), h)[_keys(h)],
            aten.scatter_add.default, Partial(), Partial(),
        ),
        (
            lambda h: h.new_zeros(2, h.shape[1]).scatter_reduce(0, _keys_2d(h), h, "sum")[_keys(h)],
            aten.scatter_reduce.two, Partial(), Partial(),
        ),
        (
            lambda h: h.new_zeros(2, h.shape[1]).scatter_reduce(0, _keys_2d(h), h, "amax")[_keys(h)],
            aten.scatter_reduce.two, R, Partial("max"),
        ),
        (
            lambda h: h.new_zeros(2, h.shape[1]).index_reduce(0, _keys(h), h, "amin")[_keys(h)],
            aten.index_reduce.default, R, Partial("min"),
        ),
    ],
    ids=["index_add", "scatter_add", "scatter_reduce-sum", "scatter_reduce-amax", "index_reduce-amin"],
)  # fmt: skip
def test_a_reduction_keyed_by_an_index_along_the_tokens_is_a_partial_all_reduced(
    mix, op, start, out
):
    """Each rank reduces its own tokens' rows into the whole output (a sum from `self` on one
    rank, a max or a min from `self` on every rank): a partial, all-reduced; the rows at each
    token's key are read on its shard, with no exchange."""
    placed, block, gm = compiled(mix)
    ((given, made, rule),) = nodes_of(placed, op)
    assert (given, made) == ((start, S0, S0), out), rule
    ((kind, why),) = block
    assert kind == "all_reduce" and why.startswith(f"{out_text(out)} -> R: "), why
    ((given, made, rule),) = nodes_of(placed, aten.index.Tensor)
    assert (given, made, rule) == ((R, S0), S0, "dsv41 (R, S(0)) -> S(0)")
    # the padding rows: the key reads row 0 of the output, the row is the reduction's identity
    (node,) = [n for n in gm.graph.nodes if n.target is op]
    index, source = node.args[2], node.args[3]
    identity = {"sum": 0, "max": float("-inf"), "min": float("inf")}[out.reduce_op]
    for masked, fill in ((index, 0), (source, identity)):
        assert masked.target is aten.where.ScalarOther and masked.meta[REAL_ROWS], masked
        assert masked.args[2] == fill, masked


@pytest.mark.parametrize(
    "mix",
    [
        lambda h: h.new_zeros(2, h.shape[1]).scatter_reduce(0, _keys_2d(h), h, "mean")[_keys(h)],
        lambda h: (
            h.new_zeros(2, h.shape[1], dtype=torch.bfloat16)
            .index_add(0, _keys(h), h.to(torch.bfloat16))
            .float()[_keys(h)]
        ),
        lambda h: h.new_zeros(2, h.shape[1]).scatter_reduce(
            0, _keys_2d(h), h, "amax", include_self=False
        )[_keys(h)],
    ],
    ids=["scatter_reduce-mean", "index_add-bf16", "scatter_reduce-amax-without-self"],
)
def test_a_keyed_reduction_whose_partials_do_not_combine_exactly_gathers_its_tokens(mix):
    """A mean (the ranks' means do not combine), a sum in bf16 (summed in another precision
    than one device's) and a max without `self` (a rank whose rows miss a key would leave
    `self` there): DTensor has no rule, so the token shards are gathered and the op runs on
    every row, as on one device."""
    placed, block, _ = compiled(mix)
    ops = (aten.scatter_reduce.two, aten.index_add.default)
    ((given, made, why),) = [p[1:] for p in placed.values() if p[0] in ops]
    assert made == R and all(p == R for p in given), (given, made)
    assert why.startswith("tokens gathered (DTensor has no rule for aten."), why
    assert block and all(kind == "all_gather" for kind, _ in block), block


def _top(h):
    """The token whose row has the largest first channel, as a tensor index (not a number)."""
    return h[:, 0].argmax(0, keepdim=True)


def test_one_row_read_at_a_computed_token_is_a_partial_of_that_row():
    """`h[top]`: the rank holding the row gives it, the others zeros; one row all-reduced
    (the argmax over the tokens gathers its scores), not a gather of the T rows."""
    placed, block, _ = compiled(lambda h: h[_top(h)])
    ((given, made, rule),) = nodes_of(placed, aten.index.Tensor)
    assert (given, made, rule) == ((S0, R), Partial(), "dsv41 (S(0), R) -> P")
    assert sorted(kind for kind, _ in block) == ["all_gather", "all_reduce"], block
    (gather,) = [why for kind, why in block if kind == "all_gather"]
    assert " argmax " in gather, gather


@pytest.mark.parametrize(
    ("mix", "op"),
    [
        (
            lambda h: h.index_put((_top(h),), h.new_ones(1, h.shape[1])) - h,
            aten.index_put.default,
        ),
        (
            lambda h: h.index_copy(0, _top(h), h.new_ones(1, h.shape[1])) - h,
            aten.index_copy.default,
        ),
    ],
    ids=["index_put", "index_copy"],
)
def test_a_write_at_a_computed_token_keeps_the_token_shard(mix, op):
    """`h.index_put((top,), v)`, `h.index_copy(0, top, v)`: each rank writes the row if it
    holds it (the others' writes land in a scratch row past the shard): no exchange but the
    argmax's."""
    placed, block, gm = compiled(mix)
    ((given, made, rule),) = nodes_of(placed, op)
    assert (given, made, rule) == ((S0, R, R), S0, "dsv41 (S(0), R, R) -> S(0)")
    assert [kind for kind, _ in block] == ["all_gather"], block
    (write,) = [n for n in gm.graph.nodes if n.target is aten.index_put.default]
    assert write.args[0].target is aten.constant_pad_nd.default  # the scratch row
    (cut,) = write.users
    assert cut.target is aten.slice.Tensor


def out_text(placement) -> str:
    return "P" if placement.reduce_op == "sum" else f"P({placement.reduce_op})"


def test_a_cumulative_sum_adds_the_totals_of_the_earlier_shards():
    placed, block, _ = compiled(lambda h: h.cumsum(0))
    ((given, made, rule),) = nodes_of(placed, aten.cumsum.default)
    assert (given, made, rule) == ((S0,), S0, "dsv41 (S(0)) -> S(0)")
    assert block == [
        (
            "all_gather",
            "shard totals for cumsum on token shards: a cumulative sum adds the totals of the "
            "shards before each: 1 row per rank, where gathering the value would move T rows",
        )
    ]


@pytest.mark.parametrize(
    ("mix", "shift"),
    [
        (lambda h: torch.cat([h.new_zeros(1, h.shape[1]), h[:-1]]), 1),
        (lambda h: F.pad(h, (0, 0, 2, 0))[: h.shape[0]], 2),
        (lambda h: torch.cat([h[1:], h.new_zeros(1, h.shape[1])]), -1),
    ],
    ids=["cat", "pad", "cat-back"],
)
def test_a_shift_is_one_op_on_the_shard_that_fetches_its_neighbours_rows(mix, shift):
    placed, block, gm = compiled(mix)
    ((given, made, rule),) = nodes_of(placed, shift_tokens._opoverload)
    assert (given, made) == ((S0, R), S0), rule
    assert not [n for n in gm.graph.nodes if n.target is shift_tokens._opoverload]  # localized
    rows = f"{abs(shift)} row" + ("s" if abs(shift) > 1 else "")
    side = "before" if shift > 0 else "after"
    assert block == [
        (
            "all_gather",
            f"neighbour rows for shift_tokens_default on token shards: a shift by {shift} needs "
            f"the {rows} {side} each shard: {rows} per rank, where gathering the value would "
            "move T rows",
        )
    ]


def test_a_roll_is_a_shift_whose_outside_rows_come_around_from_the_other_end():
    placed, block, _ = compiled(lambda h: torch.roll(h, 1, 0))
    ((given, made, rule),) = nodes_of(placed, aten.roll.default)
    assert (given, made, rule) == ((S0,), S0, "dsv41 (S(0)) -> S(0)")
    assert block == [
        (
            "all_gather",
            "wrapped rows for roll on token shards: a roll by 1 brings 1 row around from the "
            "other end, from the ranks that hold them: 1 row per rank, where gathering the "
            "value would move T rows",
        ),
        (
            "all_gather",
            "neighbour rows for roll on token shards: a shift by 1 needs the 1 row before each "
            "shard: 1 row per rank, where gathering the value would move T rows",
        ),
    ]


def test_a_roll_of_a_replicated_value_indexes_its_rows_without_an_exchange():
    placed, block, gm = compiled(lambda x: torch.roll(x, 2, 0), in_mlp=True)
    ((given, made, rule),) = nodes_of(placed, aten.roll.default)
    assert (given, made, rule) == ((R,), R, "replicated (R) -> R")
    assert block == []
    assert not [n for n in gm.graph.nodes if n.target is aten.roll.default]  # an index_select
    assert [n for n in gm.graph.nodes if n.target is aten.index_select.default]


@pytest.mark.parametrize(
    ("mix", "op", "rule"),
    [
        (
            lambda h: torch.flip(h, [0]),
            aten.flip.default,
            "tokens gathered (DTensor's rule for aten.flip.default moves the token shards of ",
        ),
        (  # a count per key: an output sized by the keys' values, no DTensor rule
            lambda h: h * torch.bincount(_keys(h), minlength=2)[_keys(h)][:, None],
            aten.bincount.default,
            "tokens gathered (DTensor has no rule for aten.bincount.default",
        ),
        (  # the tokens a mask keeps: how many is the values' business (an unbacked size)
            lambda h: h + h[torch.nonzero(h[:, 0] > 0).squeeze(1)].sum(0),
            aten.nonzero.default,
            "tokens gathered (DTensor has no rule for aten.nonzero.default",
        ),
        (
            lambda h: h + torch.masked_select(h[:, 0], h[:, 0] > 0).sum(),
            aten.masked_select.default,
            "tokens gathered (DTensor has no rule for aten.masked_select.default",
        ),
        (  # a boolean mask as an index (once an unbacked size left pending broke verify)
            lambda h: h + h[h[:, 0] > 0].sum(0),
            aten.index.Tensor,
            "tokens gathered (DTensor's rule for aten.index.Tensor refuses (S(0), S(0))",
        ),
        (  # token shards side by side along the tokens: not a token shard of the result
            lambda h: torch.cat([h, 2 * h]).unflatten(0, (2, -1)).sum(0),
            aten.cat.default,
            "dsv41 (R, R) -> R",
        ),
    ],
    ids=["flip", "bincount", "nonzero", "masked_select", "bool-mask", "cat-of-shards"],
)
def test_an_op_with_no_rule_on_token_shards_gathers_them(mix, op, rule):
    placed, block, _ = compiled(mix)
    ((given, made, why),) = nodes_of(placed, op)
    assert made == R and all(p == R for p in given) and why.startswith(rule), why
    assert block and all(kind == "all_gather" for kind, _ in block), block
    # the op's gathers (and for `nonzero`, the rows it picks read from the gathered rows)
    name = op.__name__.split(".")[0]
    assert any(reason.startswith(f"S(0) -> R: {name} ") for _, reason in block), block
    readers = (f"S(0) -> R: {name} ", "S(0) -> R: index ")
    assert all(reason.startswith(readers) for _, reason in block), block


def test_graph_py_lists_the_exchanges_beyond_the_layout_with_the_op_that_needs_them():
    """graph.py's head lists block 1's collectives beyond the toy layout's, each with the model
    line of the op that needs it and why: the roll's two exchanges, which come before the
    layout's own gather into the MLP, and not that gather."""
    _, block, gm = compiled(lambda h: torch.roll(h, 1, 0))  # graph.py names this line
    text = graph_text(gm, compiled.ctx)
    listed = [re.sub(r"\(tp\) \S+ at ", "(tp) <node> at ", line) for line in text.splitlines()]
    listed = [line for line in listed if line.startswith("#   layer ")]
    number, code = next(
        (i + 1, line.strip())
        for i, line in enumerate(Path(__file__).read_text().splitlines())
        if line.endswith("# graph.py names this line")
    )
    at = f"{__file__}:{number}: {code}"
    assert listed == [
        f"#   layer 1, attention half: all_gather(tp) <node> at {at} <- {why}" for _, why in block
    ]
    assert len(listed) == 2


def test_verify_refuses_a_statistic_that_reads_the_padding_rows():
    """The seed a faulty rewrite would plant: the sum over the tokens takes the token shard
    as it is, its padding rows unmasked (whatever the ops before left in them)."""
    _, _, gm = compiled(lambda h: h.sum(0))
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    bad = GraphModule(gm, graph)
    (reduction,) = [
        n
        for n in bad.graph.nodes
        if n.target is aten.sum.dim_IntList and n.args[0].meta.get(REAL_ROWS)
    ]
    masked = reduction.args[0]  # where(real rows, x, 0)
    reduction.replace_input_with(masked, masked.args[1])
    bad.recompile()
    with pytest.raises(InternalError) as info:
        verify(bad, ctx=dataclasses.replace(compiled.ctx, comm=[]))
    assert f"{reduction.name} reduces the token shards without setting their padding rows" in (
        str(info.value)
    )


@pytest.mark.parametrize(
    ("join", "op"),
    [
        (lambda a, b: torch.cat([a, b], -1), aten.cat.default),
        (lambda a, b: torch.stack([a, b], -1).flatten(-2), aten.stack.default),
    ],
    ids=["cat", "stack"],
)
def test_a_replicated_piece_joined_to_token_shards_is_split_by_a_local_slice(join, op):
    """The value entering the layers (replicated) side by side with one leaving them (token
    shards), joined along the features -- DSpark's captures of layer 0 and a later layer: every
    piece a token shard, the replicated one sliced locally (no collective), where DTensor's rule
    would join a whole piece to a shard (verify refused the graph as an internal error)."""
    model = ToyLM()

    def forward(self, tokens):
        first = h = self.tok(tokens)
        for block in self.blocks:
            h = block(h)
        both = join(first, h)
        return self.out(both[:, :16] + both[:, 16:])

    model.forward = forward.__get__(model)
    placed = {}

    def keep(name, gm, ctx):
        if name == "verify":
            for n in gm.graph.find_nodes(op="call_function", target=op):
                placed[n.name] = (n.meta[IN], n.meta[OUT], n.meta.get(RULE, ""))

    with toy_family(), installed(Hooks(after_pass=keep)):
        _, ctx, _ = compile_model_on_fake_rank(
            model, (TOKENS,), {"tp": 4}, world_size=4, token_inputs=(TOKENS,)
        )
    assert list(placed.values()) == [((S0, S0), S0, "dsv41 (S(0), S(0)) -> S(0)")]
    assert not [r for r in ctx.comm if "cat" in r["reason"]]  # the slice moves nothing
