"""The sharding rule of a routed-experts op (`spmd.rules.routed_experts`), here DeepSeek V4.1's."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from dsv41_compile.core.placements import ExpertShard
from dsv41_compile.deepseek_v41.adapter import DEEPSEEK_V41
from dsv41_compile.deepseek_v41.model.ops import routed_experts
from dsv41_compile.spmd.rules import strategy_for
from dsv41_compile.testing.torch_shims import fake_process_group

R, S0 = Replicate(), Shard(0)


@pytest.fixture(scope="module")
def mesh():
    with fake_process_group(world_size=4):
        yield DeviceMesh("cpu", torch.arange(4), mesh_dim_names=("tp",))


def test_routed_experts_are_token_wise_with_whole_experts(mesh):
    E, I, D, T, K = 4, 8, 16, 5, 2
    inputs = (
        torch.randn(T, D),
        torch.randint(0, E, (T, K)),
        torch.rand(T, K),
        torch.randn(E, I, D),
        torch.randn(E, D, I),
        torch.randn(E, I, D),
    )
    gm = make_fx(lambda *a: routed_experts(*a, 10.0))(*inputs)
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.dsv41.routed_experts.default)
    rules = DEEPSEEK_V41.rules
    strategy, source = strategy_for(node, (S0, R, S0, R, R, R), mesh, rules)
    assert (source, str(strategy)) == ("dsv41", "(S(0), S(0), S(0), R, R, R) -> S(0)")
    strategy, _ = strategy_for(node, (R,) * 6, mesh, rules)
    assert str(strategy) == "(R, R, R, R, R, R) -> R"
    # expert-sharded weights: every rank routes its own token shard, whatever it was given
    strategy, _ = strategy_for(
        node, (R, R, R, ExpertShard(0), ExpertShard(0), ExpertShard(0)), mesh, rules
    )
    assert str(strategy) == "(S(0), S(0), S(0), E(0), E(0), E(0)) -> S(0)"
