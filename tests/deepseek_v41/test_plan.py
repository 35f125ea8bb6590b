"""The declarative plan: parameter placements by FQN pattern, innermost anchor wins."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard

from dsv41_compile.deepseek_v41.plan import deepseek_v41_plan


def test_parameter_placements():
    plan = deepseek_v41_plan()
    assert plan.param_placement("layers.3.attn.wq_b.weight") == Shard(0)
    assert plan.param_placement("layers.3.attn.wo_a.weight") == Shard(0)
    assert plan.param_placement("layers.3.attn.wo_b.weight") == Shard(1)
    assert plan.param_placement("layers.3.attn.attn_sink") == Shard(0)
    # latents, compressor, indexer, norms, MoE, embedding and head stay replicated
    for fqn in (
        "layers.3.attn.wq_a.weight",
        "layers.3.attn.wkv.weight",
        "layers.3.attn.compressor.wkv.weight",
        "layers.3.attn.indexer.wq.weight",
        "layers.3.ffn.experts.w1",
        "embed.weight",
        "head.weight",
    ):
        assert plan.param_placement(fqn) == Replicate(), fqn
    assert deepseek_v41_plan(embedding="vocab_sharded").param_placement("embed.weight") == Shard(0)


def test_star_matches_one_path_segment():
    plan = deepseek_v41_plan()
    assert plan.param_placement("layers.3.x.attn.wq_b.weight") == Replicate()


def test_innermost_anchor_decides():
    plan = deepseek_v41_plan()
    assert plan.anchor(["layers.2", "layers.2.attn", "layers.2.attn.indexer"]) == (
        "layers.2.attn",
        Replicate(),
    )
    assert plan.anchor(["layers.2", "layers.2.hc_attn"]) == ("layers.2", Shard(0))
    assert plan.anchor(["layers.2", "layers.2.ffn", "layers.2.ffn.gate"]) == (
        "layers.2.ffn",
        Shard(0),
    )
    assert plan.anchor(["head"]) == ("head", Replicate())
    assert plan.anchor(["norm"]) is None
    assert plan.anchor([]) is None


def test_replicated_baseline_plan():
    sp, rep = deepseek_v41_plan(ep=8), deepseek_v41_plan(ep=8, layout="replicated")
    assert sp.params == rep.params  # the same parameter placements: only activations differ
    assert (sp.partial_to, rep.partial_to) == (Shard(0), Replicate())
    for paths in (["layers.2"], ["layers.2", "layers.2.attn"], ["layers.2", "layers.2.ffn"]):
        assert rep.anchor(paths) == (paths[-1], Replicate())
    # the MoE output leaves the MoE replicated; sp has no exits
    assert rep.exit(["layers.2", "layers.2.ffn", "layers.2.ffn.experts"]) == (
        "layers.2.ffn",
        Replicate(),
    )
    assert rep.exit(["layers.2", "layers.2.attn"]) is None
    assert sp.exit(["layers.2", "layers.2.ffn"]) is None


def test_unknown_layout():
    with pytest.raises(ValueError, match="'sp' and 'replicated'"):
        deepseek_v41_plan(layout="ring")
