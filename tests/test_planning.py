"""`planning.plan_rank` plans any registered model family on meta tensors: the toy family
(`testing.toy`) as well as DeepSeek V4.1 (the accounting and tools tests plan that one)."""

from __future__ import annotations

import pytest

from dsv41_compile.planning import plan_rank
from dsv41_compile.testing.fake_rank import layer_collectives
from dsv41_compile.testing.toy import ToyConfig, toy_family


def test_plan_rank_plans_the_toy_family():
    with toy_family():
        gm, ctx, model = plan_rank(ToyConfig(n_layers=3), {"tp": 4}, world_size=8, rank=5)
    assert next(model.parameters()).is_meta
    assert ctx.mesh.tp_rank == 1 and ctx.adapter.name == "toy_lm"
    assert layer_collectives(ctx.comm) == {
        layer: ["all_gather(tp)", "reduce_scatter(tp)"] for layer in range(3)
    }
    shards = {s.fqn: (s.dim, s.parts) for s in ctx.signature.param_shards.values()}
    assert shards == {
        **{f"blocks.{i}.mlp.up.weight": (0, 4) for i in range(3)},
        **{f"blocks.{i}.mlp.down.weight": (1, 4) for i in range(3)},
    }


def test_a_config_no_family_builds_is_refused():
    with pytest.raises(ValueError) as info:
        plan_rank(object(), {"tp": 4}, world_size=8)
    assert str(info.value) == (
        "plan_rank: no registered model family builds a model from a object; pass a config of "
        "a known family (dsv41_compile.deepseek_v41.model.ModelConfig) or register an adapter whose "
        "planning_example accepts it (docs/architecture.md)"
    )
