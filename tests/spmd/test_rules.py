"""Tier 1: our own rules, placements in -> placements out (FX nodes from make_fx, one-axis mesh
over a fake process group; nothing runs)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from dsv41_compile.spmd.rules import strategy_for
from dsv41_compile.testing.torch_shims import fake_process_group

R, S0, S1 = Replicate(), Shard(0), Shard(1)


@pytest.fixture(scope="module")
def mesh():
    with fake_process_group(world_size=4):
        yield DeviceMesh("cpu", torch.arange(4), mesh_dim_names=("tp",))


def node_of(fn, *inputs, target):
    gm = make_fx(fn)(*inputs)
    return next(n for n in gm.graph.nodes if n.target == target)


def test_vocab_sharded_embedding_is_a_partial_sum_with_replicated_ids(mesh):
    node = node_of(
        lambda ids, weight: torch.nn.functional.embedding(ids, weight),
        torch.randint(0, 32, (6,)),
        torch.randn(32, 8),
        target=torch.ops.aten.embedding.default,
    )
    strategy, source = strategy_for(node, (S0, R), mesh)
    assert (source, strategy.inputs, strategy.outputs) == ("dsv41", (S0, R), (Partial(),))


@pytest.mark.parametrize("T", [1, 6])
def test_view_keeping_the_token_dim_keeps_the_token_shard(mesh, T):
    # T = 1 is the case DTensor's view rule reads as a singleton dim.
    node = node_of(
        lambda x: x.view(T, -1), torch.randn(T, 4, 8), target=torch.ops.aten.view.default
    )
    strategy, source = strategy_for(node, (S0,), mesh)
    assert (source, str(strategy)) == ("dsv41", "(S(0)) -> S(0)")


def test_replicated_inputs_give_replicated_outputs_for_any_op(mesh):
    node = node_of(lambda x: x.topk(2), torch.randn(5, 8), target=torch.ops.aten.topk.default)
    strategy, source = strategy_for(node, (R,), mesh)
    assert (source, strategy.outputs) == ("replicated", (R, R))


def test_head_split_goes_to_dtensor(mesh):
    node = node_of(
        lambda x: x.view(3, 4, 8), torch.randn(3, 32), target=torch.ops.aten.view.default
    )
    strategy, source = strategy_for(node, (S1,), mesh)
    assert (source, str(strategy)) == ("dtensor", "(S(1)) -> S(1)")
