"""Presets, config validation, and the flash parameter count derived by hand."""

from __future__ import annotations

import pytest
import torch

from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(ValueError, match="unknown model preset 'huge'; presets are: tiny, flash"):
        ModelConfig.from_name("huge")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"o_groups": 3}, "o_groups .3. must divide n_heads .8."),
        ({"n_activated_experts": 17}, "n_activated_experts .17. must be <= n_routed_experts"),
        ({"rope_head_dim": 7}, "rope_head_dim .7. must be even"),
        ({"dtype": "fp16"}, "dtype must be one of"),
        ({"dim": 0}, "dim must be positive"),
    ],
)
def test_invalid_config(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_name("tiny", **change)


def test_flash_on_meta_parameter_count() -> None:
    cfg = ModelConfig.from_name("flash")
    with torch.device("meta"):
        model = DeepseekV41(cfg)
    count = sum(p.numel() for p in model.parameters())
    print(f"flash parameters: {count:,}")

    # By hand, from the V4.1-Flash sizes (D=5120, V=129280, 40 layers, H=64, d=512,
    # q_lora=1280, G=8, o_lora=1024, E=384, I=2304, n=4 streams, 24-way mHC projection):
    embed_and_head = 2 * 129280 * 5120  # untied
    final_norm = 5120
    hc_sites = 2 * (24 * 4 * 5120 + 24 + 3)  # fn [24, 4D], base [24], scale [3]; attn + ffn
    sublayer_norms = 2 * 5120
    attention = (
        5120 * 1280  # wq_a
        + 1280  # q_norm
        + 1280 * 64 * 512  # wq_b
        + 5120 * 512  # wkv
        + 512  # kv_norm
        + 64  # attn_sink
        + 8 * 1024 * 8 * 512  # wo_a: 8 groups x [1024, (64/8)*512]
        + 5120 * 8 * 1024  # wo_b
    )
    moe = 384 * 5120 + 384 + (384 + 1) * 3 * 2304 * 5120  # gate W + bias, routed + shared
    layer = hc_sites + sublayer_norms + attention + moe
    assert attention == 126_617_408
    assert moe == 13_626_900_864
    backbone = embed_and_head + final_norm + 40 * layer
    assert backbone == 551_504_296_560

    # Compressed attention (index: 32 heads x 128, rope 64). REUSE layers add nothing.
    indexer_query = 1280 * 32 * 128 + 5120 * 32  # wq_b, weights_proj
    index_keys = 512 * 128 + 128  # wk on the 512-d compressor latent, k_norm
    ratio2_full = (2 * 5120 * 512 + 512) + indexer_query + index_keys  # wkv, wgate, norm
    ratio1_full = (5120 * 512 + 512) + indexer_query + index_keys  # wkv, norm (no gate)
    reindex = indexer_query
    compressed = 3 * ratio2_full + 1 * ratio1_full + 4 * reindex  # layers 2,8,14 / 20 / 24..36
    assert compressed == 61_868_544

    # Engram before layers 1 and 14: a table of FP8 rows of 256 with an e8m0 scale per 32
    # (the primes' sums), wkv 24 x 256 -> 5 x 5120, q and k weights [4, 5120]; the token map.
    rows = 384_006_168 + 384_016_682
    engram = rows * (256 + 8) + 2 * (24 * 256 * 5 * 5120 + 2 * 4 * 5120) + 129280
    assert engram == 203_072_816_400
    assert count == backbone + compressed + engram == 754_638_981_504
