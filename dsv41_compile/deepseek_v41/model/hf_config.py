"""`ModelConfig.from_hf`: the released checkpoint's `config.json` as a validated `ModelConfig`.

Every key of `text_config` is accounted for, in one of four tables below: a `ModelConfig` field
(`FIELDS`, plus `compress_ratios` and `rope_scaling`, which need reshaping), a constant the model
hard-codes and the file must agree with (`FIXED`), a key that does not change what the model
computes (`IGNORED`, each with the reason), or a part of the released model this one does not
implement (`PARTS`: the vision tower). A part is refused unless the
caller passes `skip_unimplemented_parts=True`. Any other key is an error naming it: a key nobody
has read could change the maths.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

__all__ = ["FIELDS", "FIXED", "IGNORED", "PARTS", "QUANTIZATION", "config_to_hf", "fields_from_hf"]

FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "head_dim": "head_dim",
    "qk_rope_head_dim": "rope_head_dim",
    "q_lora_rank": "q_lora_rank",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "sliding_window": "window_size",
    "n_routed_experts": "n_routed_experts",
    "num_experts_per_tok": "n_activated_experts",
    "moe_intermediate_size": "moe_inter_dim",
    "routed_scaling_factor": "routed_scaling_factor",
    "swiglu_limit": "swiglu_limit",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "kv_source_layer_ids": "kv_source_layer_ids",
    "index_source_layer_ids": "index_source_layer_ids",
    "candidate_source_layer_id": "candidate_source_layer_id",
    "candidate_block_size": "candidate_block_size",
    "candidate_topk_blocks": "candidate_topk_blocks",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "compress_rope_theta": "compress_rope_theta",
    "engram_layer_ids": "engram_layer_ids",
    "engram_vocab_size": "engram_vocab_size",
    "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram_size",
    "engram_n_heads": "engram_n_heads",
    "engram_head_dim": "engram_head_dim",
    "engram_pad_token_id": "engram_pad_id",
    "engram_pad_id": "engram_pad_id",  # the official inference code's name for it
    "engram_compressed_vocab_size": "engram_compressed_vocab_size",
    "num_nextn_predict_layers": "num_nextn_predict_layers",
    "dspark_block_size": "dspark_block_size",
    "dspark_noise_token_id": "dspark_noise_token_id",
    "dspark_target_layer_ids": "dspark_target_layer_ids",
    "dspark_markov_rank": "dspark_markov_rank",
    "dspark_n_routed_experts": "dspark_n_routed_experts",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
    "dspark_n_activated_experts": "dspark_n_activated_experts",  # the official code's name
}
"""text_config key -> `ModelConfig` field."""

ROPE_SCALING = {
    "factor": "rope_factor",
    "original_max_position_embeddings": "original_max_position_embeddings",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
}
"""`rope_scaling` key -> `ModelConfig` field (its `rope_type` must be "yarn")."""

FIXED: dict[str, Any] = {
    "num_key_value_heads": 1,  # one shared KV latent (MQA)
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",  # top-k of score + selection bias
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
}
"""Keys whose value the model hard-codes: the file must say the same."""

IGNORED = {
    "model_type": "checked: the file must be a deepseek_v41 one",
    "max_position_embeddings": "the cache's length is chosen when it is made "
    "(`model.new_cache(num_slots, max_len)`)",
    "bos_token_id": "a tokenizer id: the model takes token ids",
    "eos_token_id": "a tokenizer id: the model takes token ids",
    "pad_token_id": "a tokenizer id: the model takes token ids",
    "torch_dtype": "the compute dtype is `ModelConfig.dtype` (bfloat16 unless overridden); "
    "FP8 weights are dequantised to it, the routed experts' FP4 weights too or kept as stored "
    '(`ModelConfig.weight_format`, "released" unless overridden), and '
    '`ModelConfig.numerics` ("official" unless overridden) rounds the activations as the '
    "official FP8 / FP4 kernels do",
    "dtype": "as torch_dtype",
    "transformers_version": "metadata",
    "architectures": "metadata",
    "auto_map": "metadata",
    "initializer_range": "training only",
    "attention_dropout": "training only",
    "use_cache": "the model always writes its cache",
}
"""Keys that do not change what the model computes, with why."""

PARTS = {
    "vision": "the vision tower",
}
"""Parts of the released model this one does not implement."""

QUANTIZATION = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}
"""The released weight format (`model.quant`); `activation_scheme` "dynamic" describes the
official kernels, which quantise activations on the fly: `ModelConfig.numerics` "official"
(`from_hf`'s default) does the same."""

_TOP_LEVEL = {"text_config", "quantization_config", "vision_config", "image_token_id"}


def _load(source: str | Path | dict[str, Any]) -> tuple[dict[str, Any], str]:
    if isinstance(source, dict):
        return source, "config"
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    return json.loads(path.read_text()), str(path)


def fields_from_hf(
    source: str | Path | dict[str, Any],
    *,
    defaults: Collection[str],
    skip_unimplemented_parts: bool = False,
) -> dict[str, Any]:
    """The `ModelConfig` fields of `source`: a checkpoint directory, its `config.json`, or that
    file's contents as a dict. `defaults` are the fields the config has a default for (the
    others must be in the file)."""
    top, where = _load(source)
    if top.get("model_type") != "deepseek_v41":
        raise ValueError(
            f"{where}: model_type is {top.get('model_type')!r}; ModelConfig.from_hf reads "
            "DeepSeek V4.1 checkpoints (model_type 'deepseek_v41')"
        )
    unknown = sorted(set(top) - _TOP_LEVEL - set(IGNORED) - set(FIXED))
    if unknown:
        raise ValueError(f"{where}: unknown top-level keys {unknown}: nothing reads them")
    for key in set(top) & set(FIXED):  # some files repeat a text setting at the top level
        _check_fixed(key, top[key], where)
    text = top.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{where}: no text_config")
    quant = top.get("quantization_config")
    if quant is not None and quant != QUANTIZATION:
        raise ValueError(
            f"{where}: quantization_config {quant} is not the released format {QUANTIZATION}"
        )

    # The released checkpoint runs in bf16 with the official FP8 / FP4 activation numerics,
    # its routed experts held in FP4 as stored.
    fields: dict[str, Any] = {
        "dtype": "bfloat16",
        "numerics": "official",
        "weight_format": "released",
    }
    parts: dict[str, list[str]] = {}
    for key, value in text.items():
        if key in FIELDS:
            fields[FIELDS[key]] = tuple(value) if isinstance(value, list) else value
        elif key in FIXED:
            _check_fixed(f"text_config.{key}", value, where)
        elif key not in IGNORED and key not in ("compress_ratios", "rope_scaling"):
            raise ValueError(
                f"{where}: text_config.{key} is not a setting this model reads, implements or "
                "knows to ignore; it may change the maths, so it is not skipped silently"
            )
    if "vision_config" in top or "image_token_id" in top:
        parts.setdefault("vision", []).extend(
            k for k in top if k in ("vision_config", "image_token_id")
        )
    if parts and not skip_unimplemented_parts:
        described = "; ".join(f"{PARTS[p]} ({', '.join(keys)})" for p, keys in parts.items())
        raise ValueError(
            f"{where} describes parts this model does not implement: {described}. Its outputs "
            "would differ from the released model's. Pass skip_unimplemented_parts=True to "
            "build the model without them"
        )

    scaling = text.get("rope_scaling")
    if not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get("type")) != "yarn":
        raise ValueError(
            f"{where}: text_config.rope_scaling is {scaling!r}; the compressed layers implement "
            "YaRN only (rope_type 'yarn')"
        )
    for key, value in scaling.items():
        if key in ROPE_SCALING:
            fields[ROPE_SCALING[key]] = value
        elif key not in ("rope_type", "type"):
            raise ValueError(f"{where}: text_config.rope_scaling.{key} is not read by this model")

    n_layers = text.get("num_hidden_layers")
    ratios = text.get("compress_ratios", [])
    drafts = text.get("num_nextn_predict_layers", 0)
    if ratios and len(ratios) != n_layers + drafts:
        raise ValueError(
            f"{where}: text_config.compress_ratios has {len(ratios)} entries; expected one per "
            f"layer and draft block, {n_layers} + {drafts}"
        )
    if any(ratios[n_layers:]):
        raise ValueError(
            f"{where}: text_config.compress_ratios gives the DSpark stages {ratios[n_layers:]}; "
            "a draft block attends over its window only (0)"
        )
    fields["compress_ratios"] = tuple(ratios[:n_layers])

    missing = sorted(k for k, f in FIELDS.items() if f not in fields and f not in defaults)
    if missing:
        raise ValueError(f"{where}: text_config lacks {missing}")
    return fields


def _check_fixed(key: str, value: Any, where: str) -> None:
    """`key` (`FIXED`'s name, maybe prefixed with where it sits) must hold the fixed value."""
    fixed = FIXED[key.removeprefix("text_config.")]
    if value != fixed:
        raise ValueError(f"{where}: {key} is {value!r}; this model implements only {fixed!r}")


def config_to_hf(cfg: Any) -> dict[str, Any]:
    """The `config.json` of a checkpoint of `cfg` (a `ModelConfig`) in the released layout (no
    vision): what `ModelConfig.from_hf` reads back as `cfg` (with `dtype`
    bfloat16, `numerics` "official" and `weight_format` "released", which the file does not
    hold)."""
    text: dict[str, Any] = {"model_type": "deepseek_v41_text"}
    written = set()
    for key, field in FIELDS.items():
        if field in written:  # a second name for a field (the official code's)
            continue
        written.add(field)
        value = getattr(cfg, field)
        text[key] = list(value) if isinstance(value, tuple) else value
    # empty: every layer window-only; else one per layer, then 0 per DSpark stage
    drafts = [0] * cfg.num_nextn_predict_layers if cfg.compress_ratios else []
    text["compress_ratios"] = list(cfg.compress_ratios) + drafts
    text["rope_scaling"] = {"rope_type": "yarn"} | {
        key: getattr(cfg, field) for key, field in ROPE_SCALING.items()
    }
    text |= FIXED
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "quantization_config": dict(QUANTIZATION),  # what `checkpoint.write_checkpoint` writes
        "text_config": text,
    }
