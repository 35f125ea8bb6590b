"""graph_mode's rewrites compute what the ops they replace compute: each op alone in a graph,
rewritten, run eagerly against the op itself (edge cases included: negative indices, an empty
index set, shifts past the end, a symbolic size, unassigned experts). torch_npu's grouped
matmul runs as `testing.torchair_standin`'s CPU kernel of its documented form."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dsv41_compile.models.deepseek_v41.graph_mode import (
    fp8_weight_decoded,
    routed_experts_fp4_grouped,
    routed_experts_grouped,
)
from dsv41_compile.targets.graph_mode import rewrite_for_graph_mode
from dsv41_compile.testing.graphs import rewritten_for_graph_mode

aten = torch.ops.aten
g = torch.Generator().manual_seed(0)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def check(op, *args, atol=0.0, **kwargs):
    gm, tensors = rewritten_for_graph_mode(op, *args, **kwargs)
    expected = op(*args, **kwargs)
    actual = gm(*tensors)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0 if atol == 0 else 1e-5)


@pytest.mark.parametrize("beta, threshold", [(1, 20), (2, 5)])
def test_softplus(beta, threshold):
    check(aten.softplus.default, randn(256) * 30, beta, threshold, atol=1e-6)


@pytest.mark.parametrize("x, other", [(randn(5, 3), -1.5), (torch.arange(15).view(5, 3), -1)])
def test_where_with_a_scalar(x, other):
    check(aten.where.ScalarOther, randn(5, 3) > 0, x, other)


def test_index_put_one_index_wraps_negatives():
    check(aten.index_put.default, randn(6, 4), [torch.tensor([0, -2, 3])], randn(3, 4))


def test_index_put_two_indices_write_the_addressed_rows():
    i, j = torch.tensor([0, 2, -1, 1]), torch.tensor([1, 4, 0, -1])
    check(aten.index_put.default, randn(3, 5, 4), [i, j], randn(4, 4))


@pytest.mark.parametrize("reduce", ["amax", "amin"])
@pytest.mark.parametrize("index", [[0, 0, 2, 4], []])
def test_scatter_reduce_keeps_untouched_slots(reduce, index):
    a = torch.tensor([3, 0, 7, 1, 2])
    src = torch.tensor([5, 1, 6, 9][: len(index)], dtype=torch.int64)
    check(aten.scatter_reduce.two, a, 0, torch.tensor(index, dtype=torch.int64), src, reduce)


def test_unflatten_and_amax():
    check(aten.unflatten.int, randn(6, 8), 1, [4, 2])
    check(aten.amax.default, randn(3, 4, 5), [0, -1])
    check(aten.amax.default, randn(3, 4, 5), [1], True)


@pytest.mark.parametrize("shift, dims", [(1, [0]), (-1, [0]), (3, [0]), (-9, [0]), (1, [])])
def test_roll(shift, dims):
    x = randn(7) if not dims else randn(7, 3)
    check(aten.roll.default, x, [shift], dims)


@pytest.mark.parametrize("shift", [1, -1])
@pytest.mark.parametrize("T", [1, 2, 7])
def test_roll_of_a_symbolic_size(shift, T):
    """The token dim is symbolic in our graphs: the rewrite may not assume a size."""
    gm = make_fx(lambda x: aten.roll.default(x, [shift], [0]), tracing_mode="symbolic")(randn(5, 3))
    assert isinstance(gm.graph.find_nodes(op="placeholder")[0].meta["val"].shape[0], torch.SymInt)
    rewrite_for_graph_mode(gm)
    assert not gm.graph.find_nodes(op="call_function", target=aten.roll.default)
    x = randn(T, 3)
    torch.testing.assert_close(gm(x), torch.roll(x, shift, 0), atol=0, rtol=0)


def test_bitwise_xor_of_hash_sized_integers():
    """Engram's rolling hash: int64 products up to 2^63, XORed."""
    a = torch.randint(0, 2**62, (64,), generator=g) * 2 + 1
    b = torch.randint(-(2**62), 2**62, (64,), generator=g)
    check(aten.bitwise_xor.Tensor, a, b)


def test_copysign_keeps_the_sign_of_a_negative_zero():
    check(
        aten.copysign.Tensor, randn(8), torch.tensor([1.0, -1.0, 0.0, -0.0, 3.0, -3.0, 2.0, -2.0])
    )


def test_routed_experts_refuse_the_official_fp8_hidden_step():
    """Graph mode's grouped matmul has no FP8 hidden step: a model with numerics="official"
    gets an error saying what to compile with, not a program without the step."""
    args = (None,) * 9
    with pytest.raises(NotImplementedError, match="lowering='eager' or 'inductor'"):
        routed_experts_grouped(*args, fp8_hidden=True)


@pytest.mark.parametrize("rewrite", [fp8_weight_decoded, routed_experts_fp4_grouped])
def test_weights_held_as_released_are_refused_with_what_compiles(rewrite):
    """torch_npu's quantised matmuls are not mapped yet: a model with weight_format="released"
    gets an error saying what to compile with, not a graph that decodes every weight."""
    with pytest.raises(NotImplementedError, match="weight_format='dequantized'"):
        rewrite(None, None)
