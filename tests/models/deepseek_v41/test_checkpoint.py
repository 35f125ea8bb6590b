"""A synthetic checkpoint of tiny (every attention mode) in the released format, written by
`testing.checkpoints` (tools/make_checkpoint.py's) and read back by `load_checkpoint`: the names and formats, the values
within the quantisation's computed error, and every way a checkpoint is refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsv41_compile.model import DeepseekV41, ModelConfig, load_checkpoint
from dsv41_compile.models.deepseek_v41.checkpoint import INDEX, checkpoint_layout
from dsv41_compile.models.deepseek_v41.quant import CODECS
from dsv41_compile.testing.checkpoints import synthetic_checkpoint

CFG = ModelConfig.from_name("tiny")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_ckpt")
    original = synthetic_checkpoint(CFG, out, seed=3, files=3)
    return out, original


def copy_of(written, tmp_path):
    out, _ = written
    shutil.copytree(out, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_the_released_names_formats_and_files(written):
    out, _ = written
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        INDEX,
    ]
    weight_map = json.loads((out / INDEX).read_text())["weight_map"]
    tensors = {}
    for shard in set(weight_map.values()):
        tensors |= load_file(str(out / shard))
    assert set(tensors) == set(weight_map)
    expect = {
        "embed.weight": (torch.bfloat16, [512, 64]),
        "layers.0.hc_attn_fn": (torch.float32, [24, 256]),
        "layers.0.attn.attn_sink": (torch.float32, [8]),
        "layers.0.attn.wq_b.weight": (torch.float8_e4m3fn, [256, 32]),
        "layers.0.attn.wq_b.scale": (torch.float8_e8m0fnu, [8, 1]),
        "layers.0.ffn.gate.bias": (torch.float32, [16]),
        "layers.0.ffn.experts.15.w2.weight": (torch.int8, [64, 16]),  # [out, in/2]
        "layers.0.ffn.experts.15.w2.scale": (torch.float8_e8m0fnu, [64, 1]),  # [out, in/32]
        "layers.0.ffn.shared_experts.w1.weight": (torch.float8_e4m3fn, [32, 64]),
        "layers.2.attn.compressor.wgate.weight": (torch.bfloat16, [32, 64]),
        "layers.2.attn.indexer.wq_b.scale": (torch.float8_e8m0fnu, [1, 1]),
        "head.weight": (torch.bfloat16, [512, 64]),
    }
    for name, (dtype, shape) in expect.items():
        assert (tensors[name].dtype, list(tensors[name].shape)) == (dtype, shape), name
    n_experts = sum(n.endswith(".w1.weight") and ".experts." in n for n in tensors)
    assert n_experts == CFG.n_layers * CFG.n_routed_experts
    assert ModelConfig.from_hf(out, dtype="float32") == CFG


def test_the_loaded_model_is_the_written_one_within_the_quantisation_error(written):
    out, original = written
    torch.manual_seed(99)
    loaded = DeepseekV41(CFG)
    read = load_checkpoint(loaded, out)
    total = json.loads((out / INDEX).read_text())["metadata"]["total_size"]
    assert sum(read.values()) == total  # every tensor read once
    want, got = original.state_dict(), loaded.state_dict()
    for name, entry in checkpoint_layout(original).items():
        w, v = entry.part_of(want[entry.param]), entry.part_of(got[entry.param])
        if entry.quantized:
            codec = CODECS[entry.fmt]
            q, scale = codec.quantize(w)
            assert torch.equal(v, codec.dequantize(q, scale, torch.float32, name)), name
            assert ((v - w).abs() <= codec.error_bound(w, scale)).all(), name
        elif entry.fmt == "bf16":
            assert torch.equal(v, w.to(torch.bfloat16).float()), name  # one bf16 rounding
        else:
            assert torch.equal(v, w), name


def test_unimplemented_parts_are_refused_unless_skipped_by_name(written, tmp_path):
    root = copy_of(written, tmp_path)
    extra = {"layers.1.engram.wkv.weight": torch.zeros(4, 4), "mtp.0.norm.weight": torch.ones(4)}
    save_file(extra, str(root / "extra.safetensors"))
    index = json.loads((root / INDEX).read_text())
    index["weight_map"] |= dict.fromkeys(extra, "extra.safetensors")
    (root / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError) as error:
        load_checkpoint(DeepseekV41(CFG), root)
    assert str(error.value) == (
        f"{root / INDEX}: 2 tensors of parts this model does not implement (Engram, DSpark "
        "draft blocks, vision), e.g. ['layers.1.engram.wkv.weight', 'mtp.0.norm.weight']. Its "
        "outputs would differ from the released model's. Pass skip_unimplemented_parts=True to "
        "load without them"
    )
    assert "extra.safetensors" not in load_checkpoint(
        DeepseekV41(CFG), root, skip_unimplemented_parts=True
    )


def rewrite(root, name, value):
    """`name` replaced by `value` in its shard."""
    shard = json.loads((root / INDEX).read_text())["weight_map"][name]
    tensors = load_file(str(root / shard))
    tensors[name] = value
    save_file(tensors, str(root / shard))
    return shard


def test_a_wrong_dtype_or_shape_names_the_tensor_and_its_file(written, tmp_path):
    root = copy_of(written, tmp_path)
    shard = rewrite(root, "layers.1.attn.wo_b.weight", torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError) as error:
        load_checkpoint(DeepseekV41(CFG), root)
    assert str(error.value) == (
        f"layers.1.attn.wo_b.weight ({shard}): torch.bfloat16 [64, 64], expected "
        "torch.float8_e4m3fn [64, 64]"
    )


def test_a_nan_scale_names_the_tensor_and_its_file(written, tmp_path):
    root = copy_of(written, tmp_path)
    name = "layers.4.ffn.experts.3.w1.scale"
    with safe_open(
        str(root / json.loads((root / INDEX).read_text())["weight_map"][name]), "pt"
    ) as f:
        scale = f.get_tensor(name).view(torch.uint8).clone()
    scale[5, 1] = 255
    shard = rewrite(root, name, scale.view(torch.float8_e8m0fnu))
    weight_shard = json.loads((root / INDEX).read_text())["weight_map"][
        "layers.4.ffn.experts.3.w1.weight"
    ]
    with pytest.raises(ValueError) as error:
        load_checkpoint(DeepseekV41(CFG), root)
    assert str(error.value) == (
        f"layers.4.ffn.experts.3.w1.weight ({weight_shard}): scale byte 255 (NaN) at [5, 1], "
        "1 in all: the checkpoint is damaged (a released scale is a power of two)"
    )
    assert shard.endswith(".safetensors")


def test_a_missing_or_unknown_tensor_is_an_error(written, tmp_path):
    root = copy_of(written, tmp_path)
    index = json.loads((root / INDEX).read_text())
    del index["weight_map"]["layers.0.attn.q_norm.weight"]
    (root / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"missing 1 tensors, e\.g\. \['layers\.0\.attn\.q_norm"):
        load_checkpoint(DeepseekV41(CFG), root)
    with pytest.raises(ValueError, match="tensors this model does not have"):
        load_checkpoint(DeepseekV41(CFG.replace(n_layers=2, compress_ratios=(0, 0),
                                                kv_source_layer_ids=(), index_source_layer_ids=(),
                                                candidate_source_layer_id=-1)), written[0])  # fmt: skip
