"""The sharding plan's vocabulary and its check against a model: a pattern that matches nothing
is refused, naming it and the closest names, unless its entry says why it may."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from dsv41_compile.core.plan import SCALES, Entry, ShardingPlan, colwise, rowwise, with_scales
from dsv41_compile.testing.fake_rank import compile_model_on_fake_rank
from dsv41_compile.testing.toy import ToyAdapter, ToyLM, toy_family

PARAMS = ["tok.weight", "blocks.0.mlp.up.weight", "blocks.1.mlp.up.weight", "out.weight"]
MODULES = ["tok", "blocks.0", "blocks.0.mlp", "blocks.1", "blocks.1.mlp", "out"]


def test_the_vocabulary_writes_a_linears_entries_and_its_scales_may_be_absent():
    assert colwise("a.b") == (Entry("a.b.weight", Shard(0)),)
    assert rowwise("a.b", scales=True) == (
        Entry("a.b.weight", Shard(1)),
        Entry("a.b.scale", Shard(1), optional=SCALES),
    )
    assert with_scales("e.w1", Shard(0), "e.w1_scale")[1].optional == SCALES
    # pairs are still rows
    plan = ShardingPlan(params=(("x.weight", Shard(0)),), anchors=(("blocks.*", Shard(0)),))
    assert plan.params == (Entry("x.weight", Shard(0)),)
    assert plan.param_placement("x.weight") == Shard(0)
    assert plan.param_placement("y.weight") == Replicate()


def test_a_pattern_that_matches_nothing_is_named_with_the_closest_names():
    plan = ShardingPlan(
        params=(*colwise("blocks.*.mlp.upp"), *rowwise("blocks.*.mlp.down", scales=True)),
        anchors=(Entry("blocks.*", Shard(0)), Entry("blocks.*.mpl", Replicate())),
    )
    with pytest.raises(ValueError) as info:
        plan.check_matches(PARAMS, MODULES)
    assert str(info.value) == (
        "the sharding plan names what this model does not have -- its parameters would "
        "silently stay replicated, or its activations unplaced: params pattern "
        "'blocks.*.mlp.upp.weight' matches no parameter (closest: blocks.*.mlp.up.weight); "
        "params pattern 'blocks.*.mlp.down.weight' matches no parameter (closest: "
        "blocks.*.mlp.up.weight); anchors pattern 'blocks.*.mpl' matches no module (closest: "
        "blocks.*.mlp, blocks.*). Correct the pattern (`*` stands for one path segment), or mark "
        "an entry that may match nothing as optional (core.plan.Entry)"
    )
    # the scales entry matched nothing too, and said it may
    ShardingPlan(params=rowwise("blocks.*.mlp.up", scales=True), anchors=()).check_matches(
        PARAMS, MODULES
    )


class _Misspelt(ToyAdapter):
    name = "toy_lm_misspelt"

    def plan(self, options):
        plan = super().plan(options)
        return ShardingPlan(
            params=(Entry("blocks.*.mlp.up.wieght", Shard(0)),), anchors=plan.anchors
        )


def test_a_compile_with_a_misspelt_plan_fails_naming_the_pattern():
    from dsv41_compile import families

    with toy_family(), families.REGISTRY.restored():
        families.register_adapter(_Misspelt())
        with pytest.raises(Exception) as info:
            compile_model_on_fake_rank(ToyLM(), (torch.arange(8),), {"tp": 4})
    error = info.value
    while getattr(error, "inner_exception", None) is not None:
        error = error.inner_exception
    assert isinstance(error, ValueError)
    assert "params pattern 'blocks.*.mlp.up.wieght' matches no parameter (closest: " in str(error)
    assert "blocks.*.mlp.up.weight" in str(error)
