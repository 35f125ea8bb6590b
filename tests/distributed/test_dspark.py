"""Speculative decoding on 4 gloo ranks (tp=2, dp=2, ep=4): the backbone and the DSpark drafter
each compiled once by `dsv41_sp` in the sp layout (the seed's 8 ranks are
tests/distributed/test_numerics.py's; half the ranks trace half as much on two cores), driven
by `serving.generate` on every rank as under `torchrun`, give exactly the tokens of plain
greedy decoding on one device for three requests of different lengths, 40 new tokens each. The
model is tiny-dspark cut to four backbone layers (window-only with Engram, ratio-2 FULL, ratio-1
FULL making candidates, ratio-1 REUSE; the drafter reading layers 1-3), loaded from a synthetic
checkpoint in the released layout (`mtp.*` tensors and all), in fp32. tests/test_serving.py
decodes the whole tiny-dspark on one device."""

from __future__ import annotations

import pytest
import torch

from dsv41_compile.deepseek_v41.model import ModelConfig
from dsv41_compile.deepseek_v41.serving import generate
from dsv41_compile.deepseek_v41.testing.checkpoints import synthetic_checkpoint
from dsv41_compile.deepseek_v41.testing.speculative import DecodeSpec, decode_on_rank, model_of
from dsv41_compile.testing.multirank import RankPool

pytestmark = pytest.mark.slow

LENGTHS, NEW = (3, 11, 6), 40
FOUR_LAYERS = {
    "n_layers": 4,
    "compress_ratios": (0, 2, 1, 1),
    "kv_source_layer_ids": (1, 2),
    "index_source_layer_ids": (1, 2),
    "candidate_source_layer_id": 2,
    "engram_layer_ids": (0,),
    "dspark_target_layer_ids": (1, 2, 3),
}
"""Every attention kind but REINDEX and a ratio-2 REUSE: half of tiny's layers to compile."""
SP = (("tp", 2), ("ep", 4), ("lowering", "eager"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_dspark")
    cfg = ModelConfig.from_name("tiny-dspark", hc_sinkhorn_iters=3, **FOUR_LAYERS)
    synthetic_checkpoint(cfg, root)
    g = torch.Generator().manual_seed(1)
    prompts = tuple(tuple(torch.randint(0, 511, (n,), generator=g).tolist()) for n in LENGTHS)
    float32 = (("dtype", "float32"), ("numerics", "bf16"), ("weight_format", "dequantized"))
    spec = DecodeSpec(
        checkpoint=str(root), overrides=float32, prompts=prompts, max_new_tokens=NEW, options=SP
    )
    reference = generate(model_of(spec), [list(p) for p in prompts], NEW, speculative=False)
    return reference, RankPool.shared(4).run(decode_on_rank, spec)


def test_every_rank_decodes_exactly_the_greedy_tokens(run):
    reference, results = run
    assert [len(t) for t in reference.tokens] == [NEW] * len(LENGTHS)
    for rank, result in enumerate(results):
        assert result["tokens"] == reference.tokens, rank
        # proposals were verified every step after the prefill, some kept
        assert sum(result["step_proposed"]) > 0 and sum(result["step_accepted"]) > 0


def test_one_program_each_with_the_layout_of_the_backbone(run):
    _, results = run
    for rank, result in enumerate(results):
        programs = result["programs"]
        assert sorted(p["drafter"] for p in programs) == [False, True], rank
        (drafter,) = (p["by_part"] for p in programs if p["drafter"])
        (backbone,) = (p["by_part"] for p in programs if not p["drafter"])
        for stage in range(3):
            # the stage's attention: its input gathered over tp, the exit moving rows back (the
            # all-to-all of wo_b's input in attention, or wo_b's partial reduce-scattered at
            # the layer's residual add: attn_exit="auto" at 8 rows per step); its MoE
            # expert-parallel over the world: dispatch and combine all-to-alls
            assert drafter[(stage, "attention", "all_gather")] == 1
            assert (
                drafter.get((stage, "attention", "all_to_all"), 0)
                + drafter.get((stage, "layer", "reduce_scatter"), 0)
                == 1
            )
            assert drafter[(stage, "moe", "all_to_all")] >= 2
        assert not any(layer is not None and layer > 2 for layer, _, _ in drafter)
        assert drafter[(None, "exit", "all_gather")] == 1  # the head's logits
        # the backbone's call: its 4 layers, and two more gathers: of the captures the drafter
        # reads (token-sharded where they are made, every rank's drafter reads them all), and of
        # the normed hidden, indexed by the rows whose logits the step asks for (`logit_rows`)
        layers = {layer for layer, _, _ in backbone if layer is not None}
        assert layers == set(range(4))
        assert backbone[(None, "", "all_gather")] == 2
