"""`ModelConfig.from_hf` on the released V4.1-Flash `config.json` and on every way it refuses.

data/v41_flash_config.json holds the released file's keys that describe the model (the
released `config.json` of huggingface.co/deepseek-ai/DeepSeek-V4.1-Flash, its tokenizer ids and
version metadata left out)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from dsv41_compile.deepseek_v41.model import PRESETS, ModelConfig
from dsv41_compile.deepseek_v41.model.hf_config import config_to_hf

RELEASED = json.loads((Path(__file__).parent / "data" / "v41_flash_config.json").read_text())
FLASH_OFFICIAL = PRESETS["flash-dspark"].replace(numerics="official", weight_format="released")
"""What the released config reads as: the flash preset with its DSpark stages and the official
numerics, its routed experts held as released."""


def test_the_released_config_is_the_flash_preset_with_the_official_numerics():
    assert ModelConfig.from_hf(RELEASED, skip_unimplemented_parts=True) == FLASH_OFFICIAL
    bf16 = ModelConfig.from_hf(
        RELEASED, skip_unimplemented_parts=True, numerics="bf16", weight_format="dequantized"
    )
    assert bf16 == PRESETS["flash-dspark"]


def test_a_checkpoint_directory_or_its_config_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASED))
    for source in (tmp_path, tmp_path / "config.json", str(tmp_path)):
        assert ModelConfig.from_hf(source, skip_unimplemented_parts=True) == FLASH_OFFICIAL


def test_the_parts_this_model_lacks_are_refused_unless_skipped_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASED))
    with pytest.raises(ValueError) as error:
        ModelConfig.from_hf(tmp_path)
    assert str(error.value) == (
        f"{tmp_path / 'config.json'} describes parts this model does not implement: the "
        "vision tower (image_token_id, vision_config). Its outputs would differ from the "
        "released model's. Pass skip_unimplemented_parts=True to build the model without them"
    )


def test_a_config_written_for_a_model_reads_back_as_that_model():
    for name in ("tiny", "tiny-swa", "flash", "tiny-dspark", "flash-dspark"):
        cfg = PRESETS[name]
        read = ModelConfig.from_hf(
            config_to_hf(cfg),
            dtype=cfg.dtype,
            numerics=cfg.numerics,
            weight_format=cfg.weight_format,
        )
        assert read == cfg, name


def test_overrides_replace_fields_after_reading():
    cfg = ModelConfig.from_hf(
        RELEASED, skip_unimplemented_parts=True, dtype="float32", numerics="bf16"
    )
    assert cfg.dtype == "float32" and cfg.dim == 5120
    # "official" computes in bf16: a float32 override must say numerics="bf16" too
    with pytest.raises(
        ValueError, match="use dtype='bfloat16' .got 'float32'., or numerics='bf16'"
    ):
        ModelConfig.from_hf(RELEASED, skip_unimplemented_parts=True, dtype="float32")


def edited(change) -> dict:
    config = copy.deepcopy(RELEASED)
    change(config["text_config"])
    return config


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda t: t.update(scoring_func="softmax"),
            "config: text_config.scoring_func is 'softmax'; this model implements only "
            "'sqrtsoftplus'",
        ),
        (
            lambda t: t.update(n_shared_experts=2),
            "config: text_config.n_shared_experts is 2; this model implements only 1",
        ),
        (
            lambda t: t.update(qk_nope_head_dim=128),
            "config: text_config.qk_nope_head_dim is not a setting this model reads, "
            "implements or knows to ignore; it may change the maths, so it is not skipped "
            "silently",
        ),
        (
            lambda t: t["rope_scaling"].update(rope_type="linear"),
            "config: text_config.rope_scaling is {'rope_type': 'linear', 'factor': 16, "
            "'beta_fast': 32, 'beta_slow': 1, 'original_max_position_embeddings': 65536}; the "
            "compressed layers implement YaRN only (rope_type 'yarn')",
        ),
        (
            lambda t: t["rope_scaling"].update(mscale=0.7),
            "config: text_config.rope_scaling.mscale is not read by this model",
        ),
        (
            lambda t: t.update(compress_ratios=t["compress_ratios"][:40]),
            "config: text_config.compress_ratios has 40 entries; expected one per layer and "
            "draft block, 40 + 3",
        ),
        (
            lambda t: t.pop("hidden_size"),
            "config: text_config lacks ['hidden_size']",
        ),
    ],
    ids=["fixed", "shared-experts", "unknown", "rope-type", "rope-key", "ratios", "missing"],
)
def test_a_setting_the_model_does_not_implement_is_an_error_naming_it(change, message):
    with pytest.raises(ValueError) as error:
        ModelConfig.from_hf(edited(change), skip_unimplemented_parts=True)
    assert str(error.value) == message


def test_top_level_keys_are_read_checked_or_refused():
    repeated = copy.deepcopy(RELEASED) | {"tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    assert ModelConfig.from_hf(repeated, skip_unimplemented_parts=True) == FLASH_OFFICIAL
    with pytest.raises(ValueError, match="tie_word_embeddings is True; this model implements"):
        ModelConfig.from_hf(repeated | {"tie_word_embeddings": True})
    with pytest.raises(ValueError, match=r"unknown top-level keys \['rope_parameters'\]"):
        ModelConfig.from_hf(repeated | {"rope_parameters": {}})


def test_another_model_or_weight_format_is_refused():
    other = copy.deepcopy(RELEASED) | {"model_type": "deepseek_v3"}
    with pytest.raises(ValueError, match="model_type is 'deepseek_v3'"):
        ModelConfig.from_hf(other)
    fp8_128 = copy.deepcopy(RELEASED)
    fp8_128["quantization_config"]["weight_block_size"] = [128, 128]
    with pytest.raises(ValueError, match="is not the released format"):
        ModelConfig.from_hf(fp8_128, skip_unimplemented_parts=True)
