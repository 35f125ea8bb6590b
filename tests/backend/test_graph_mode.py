"""graph_mode's rewrites compute what the ops they replace compute: each op alone in a graph,
rewritten, run eagerly against the op itself (edge cases included: negative indices, an empty
index set, shifts past the end, a symbolic size, unassigned experts). torch_npu's grouped
matmul runs as `testing.torchair_standin`'s CPU kernel of its documented form."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dsv41_compile.lowering.graph_mode import grouped_matmul, rewrite_for_graph_mode
from dsv41_compile.model.ops import routed_experts
from dsv41_compile.testing.torchair_standin import register_npu_ops

aten = torch.ops.aten
g = torch.Generator().manual_seed(0)
register_npu_ops()  # torch_npu's grouped matmul: schema + CPU kernel of the form graph mode uses


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def rewritten(op, *args, **kwargs) -> GraphModule:
    """`op(*args, **kwargs)` as a one-node graph (tensors are its inputs), rewritten."""
    graph, tensors = Graph(), []

    def lift(value):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return graph.placeholder(f"t{len(tensors)}")
        if isinstance(value, (list, tuple)):
            return type(value)(lift(v) for v in value)
        return value

    graph.output(graph.call_function(op, lift(args), lift(kwargs)))
    gm = GraphModule(torch.nn.Module(), graph)
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate(*tensors)
    rewrite_for_graph_mode(gm)
    assert not any(n.target is op for n in gm.graph.nodes), f"{op} was not rewritten"
    gm.tensors = tensors
    return gm


def check(op, *args, atol=0.0, **kwargs):
    gm = rewritten(op, *args, **kwargs)
    expected = op(*args, **kwargs)
    actual = gm(*gm.tensors)
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


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("limit", [0.0, 0.5])
def test_routed_experts_through_the_grouped_matmul_match_the_kernel(dtype, atol, limit):
    T, K, E, I, D = 12, 3, 4, 8, 16
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[[2, 7]] = -1  # padding rows: routed nowhere
    idx[0, 1] = -1  # and one unassigned pick of a real row
    weight = torch.rand(T, K, generator=g)
    args = (randn(T, D, dtype=dtype), idx, weight)
    experts = tuple(randn(*shape, dtype=dtype) for shape in ((E, I, D), (E, D, I), (E, I, D)))
    gm = rewritten(torch.ops.dsv41.routed_experts.default, *args, *experts, limit)
    assert gm.graph.find_nodes(op="call_function", target=grouped_matmul())
    got = gm(*gm.tensors)
    torch.testing.assert_close(got, routed_experts(*args, *experts, limit), atol=atol, rtol=1e-2)
    assert got[[2, 7]].abs().max() == 0  # (the stand-in kernel leaves NaN past the groups)


def test_grouped_matmul_stand_in_is_the_documented_form_only():
    x, w, counts = randn(6, 4), randn(2, 4, 3), torch.tensor([2, 3])
    (out,) = grouped_matmul()([x], [w], group_list=counts, split_item=3, group_type=0,
                              group_list_type=1)  # fmt: skip
    torch.testing.assert_close(out[:5], torch.cat([x[:2] @ w[0], x[2:5] @ w[1]]))
    assert out[5].isnan().all()  # past the last group: not written
    with pytest.raises(ValueError, match="implements one form"):
        grouped_matmul()([x], [w], group_list=counts.cumsum(0), split_item=3, group_type=0,
                         group_list_type=0)  # fmt: skip
