"""A synthetic checkpoint of tiny (every attention mode) in the released format, written by
`deepseek_v41.testing.checkpoints` (tools/make_checkpoint.py's) and read back by `load_checkpoint`: the names and formats, the values
within the quantisation's computed error, and every way a checkpoint is refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsv41_compile.core.adapter import WeightInput, WeightSlice
from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig, checkpoint, load_checkpoint
from dsv41_compile.deepseek_v41.model.checkpoint import (
    INDEX,
    WantedWeight,
    checkpoint_layout,
    read_weights,
)
from dsv41_compile.deepseek_v41.model.quant import CODECS
from dsv41_compile.deepseek_v41.testing.checkpoints import synthetic_checkpoint

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
        "tokenizer.json",
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
        # Engram before layer 1: the table as stored (FP8 rows, an e8m0 scale per 32)
        "layers.1.engram.embed.weight": (torch.float8_e4m3fn, [384, 32]),
        "layers.1.engram.embed.scale": (torch.float8_e8m0fnu, [384, 1]),
        "layers.1.engram.wkv.weight": (torch.float8_e4m3fn, [320, 192]),
        "layers.1.engram.wkv.scale": (torch.float8_e8m0fnu, [10, 6]),
        "layers.1.engram.q_weight": (torch.bfloat16, [4, 64]),
        "layers.1.engram.k_weight": (torch.bfloat16, [4, 64]),
    }
    for name, (dtype, shape) in expect.items():
        assert (tensors[name].dtype, list(tensors[name].shape)) == (dtype, shape), name
    n_experts = sum(n.endswith(".w1.weight") and ".experts." in n for n in tensors)
    assert n_experts == CFG.n_layers * CFG.n_routed_experts
    read = ModelConfig.from_hf(out, dtype="float32", numerics="bf16", weight_format="dequantized")
    assert read == CFG


def test_the_loaded_model_is_the_written_one_within_the_quantisation_error(written):
    out, original = written
    torch.manual_seed(99)
    loaded = DeepseekV41(CFG)
    read = load_checkpoint(loaded, out)
    total = json.loads((out / INDEX).read_text())["metadata"]["total_size"]
    assert read.pop("tokenizer.json") == (out / "tokenizer.json").stat().st_size
    assert sum(read.values()) == total  # every tensor read once
    want, got = original.state_dict(), loaded.state_dict()
    assert torch.equal(got["engram_hash.token_map"], want["engram_hash.token_map"])
    for name, entry in checkpoint_layout(original).items():
        w, v = entry.part_of(want[entry.param]), entry.part_of(got[entry.param])
        if entry.quantized:
            codec = CODECS[entry.fmt]
            q, scale = codec.quantize(w)
            assert torch.equal(v, codec.dequantize(q, scale, torch.float32, name)), name
            assert ((v - w).abs() <= codec.error_bound(w, scale)).all(), name
        elif entry.fmt == "bf16":
            assert torch.equal(v, w.to(torch.bfloat16).float()), name  # one bf16 rounding
        elif entry.fmt in ("e4m3", "e8m0"):  # the Engram table, as stored
            assert torch.equal(v.view(torch.uint8), w.view(torch.uint8)), name
        else:
            assert torch.equal(v, w), name


def test_unimplemented_parts_are_refused_unless_skipped_by_name(written, tmp_path):
    root = copy_of(written, tmp_path)
    extra = {"vision.patch.weight": torch.zeros(4, 4), "mtp.0.norm.weight": torch.ones(4)}
    save_file(extra, str(root / "extra.safetensors"))
    index = json.loads((root / INDEX).read_text())
    index["weight_map"] |= dict.fromkeys(extra, "extra.safetensors")
    (root / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError) as error:
        load_checkpoint(DeepseekV41(CFG), root)
    assert str(error.value) == (
        f"{root / INDEX}: 1 tensors of the DSpark draft blocks, e.g. ['mtp.0.norm.weight'], "
        "which this model was built without: build it from a config with them "
        "(ModelConfig.from_hf reads num_nextn_predict_layers), or pass "
        "skip_unimplemented_parts=True to load the backbone alone"
    )
    # the drafter's tensors are another program's when the backend reads the backbone's
    weights = [
        WantedWeight(f, tuple(p.shape), p.dtype) for f, p in DeepseekV41(CFG).named_parameters()
    ]
    with pytest.raises(ValueError) as error:
        read_weights(root, weights)
    assert str(error.value) == (
        f"{root / INDEX}: 1 tensors of parts this model does not implement (vision), e.g. "
        "['vision.patch.weight']. Its outputs would differ from the released model's. Pass "
        "skip_unimplemented_parts=True to load without them"
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


TP_SHARDS = {  # the plan's tp shards of tiny: FQN -> dim (wo_b's quarter is 16 of 64 columns:
    "layers.2.attn.wq_b.weight": 0,  # half a scale block)
    "layers.2.attn.wo_a.weight": 0,
    "layers.2.attn.wo_b.weight": 1,
    "layers.2.attn.attn_sink": 0,
}


@pytest.mark.parametrize("chunk", [None, 3 * 32 * 32], ids=["one_chunk", "chunks_of_96_rows"])
def test_a_rank_reads_exactly_its_slices(written, chunk, monkeypatch):
    """`read_weights` with each tp rank's slices (and an EP rank's experts) gives the slices of
    the whole model loaded from the same checkpoint, and reads only their bytes (FP8: the
    weight's rows or columns, and the scale blocks they touch). Also decoded in chunks of 96
    rows, which a rank's 64 rows of wq_b start inside."""
    if chunk is not None:
        monkeypatch.setattr(checkpoint, "_CHUNK", chunk)
    out, _ = written
    whole = DeepseekV41.without_weights(CFG)
    load_checkpoint(whole, out)
    params = dict(whole.named_parameters())

    def rank_inputs(tp_rank, ep_rank):
        inputs = []
        for fqn, p in params.items():
            part = None
            if fqn in TP_SHARDS:
                part = WeightSlice(TP_SHARDS[fqn], tp_rank, 4)
            elif ".ffn.experts." in fqn:
                part = WeightSlice(0, ep_rank, 8)
            inputs.append(WeightInput(fqn, tuple(p.shape), p.dtype, part))
        return inputs

    for tp_rank in range(4):
        inputs = rank_inputs(tp_rank, ep_rank=tp_rank + 3)
        local, read = read_weights(out, inputs)
        for w, value in zip(inputs, local):
            want = params[w.fqn]
            if w.slice is not None:
                want = want.chunk(w.slice.parts, w.slice.dim)[w.slice.index]
            assert torch.equal(value, want), w.fqn
        assert read["layers.2.attn.wo_b.weight"] == 64 * 16  # fp8: one byte each
        assert read["layers.2.attn.wo_b.scale"] == 2 * 1  # 2 row blocks x the 1 it touches
        assert read["layers.2.attn.wq_b.weight"] == 256 // 4 * 32
        assert read["layers.2.attn.wq_b.scale"] == 2 * 1  # 64 rows: 2 blocks of 32
        assert read["layers.2.attn.attn_sink"] == 8 // 4 * 4
        experts = {n.split(".")[4] for n in read if ".ffn.experts." in n}
        assert experts == {str(2 * (tp_rank + 3)), str(2 * (tp_rank + 3) + 1)}
        assert read["layers.2.attn.wkv.weight"] == 32 * 64  # replicated: all of it


def test_a_model_without_weights_refuses_to_run_until_loaded(written):
    out, _ = written
    model = DeepseekV41.without_weights(CFG)
    assert all(p.untyped_storage().nbytes() <= p.element_size() for p in model.parameters())
    batch = (torch.tensor([1, 2]), torch.arange(2), torch.zeros(2, dtype=torch.int64))
    message = (
        "this DeepseekV41 has no weights (built on the meta device or by "
        "DeepseekV41.without_weights): call load_checkpoint(model, DIR) first, or compile "
        "DeepseekV41.without_weights(cfg) with the dsv41_sp backend's option checkpoint=DIR, "
        "where each rank reads only its own shards"
    )
    with pytest.raises(ValueError) as error:
        model(*batch, model.new_cache(1, 8))
    assert str(error.value) == message
    with torch.device("meta"):
        on_meta = DeepseekV41(CFG)
    with pytest.raises(ValueError) as error:
        on_meta(*batch, model.new_cache(1, 8))
    assert str(error.value) == message
    load_checkpoint(model, out)  # allocates and fills
    assert model(*batch, model.new_cache(1, 8)).shape == (2, CFG.vocab_size)


def test_a_rank_loading_holds_its_own_weights_plus_one_tensor(tmp_path):
    """Rank 5 of tp=4, ep=8 reads its slices of a 110 MB model in a fresh process: its
    anonymous memory (sampled every 0.2 ms) peaks below its own weights plus the largest
    tensor plus 4 MiB (the fp32 temporaries of one decode chunk of 2^18 elements,
    `checkpoint._CHUNK`) -- far below the whole model. Allocations of 64 KiB and more are
    mapped and unmapped one by one (MALLOC_MMAP_THRESHOLD_), so the memory measured is what is
    alive, not what glibc keeps cached after a free (that added up to 6 MiB, varying)."""
    cfg = ModelConfig.from_name("tiny-swa", dim=512, moe_inter_dim=512)
    synthetic_checkpoint(cfg, tmp_path)
    code = (
        "import json\n"
        "from dsv41_compile.deepseek_v41.model import ModelConfig\n"
        "from dsv41_compile.deepseek_v41.testing.checkpoints import loading_peak, rank_weight_inputs\n"
        "cfg = ModelConfig.from_name('tiny-swa', dim=512, moe_inter_dim=512)\n"
        "inputs = rank_weight_inputs(cfg, {'tp': 4, 'ep': 8}, 5)\n"
        f"print(json.dumps(loading_peak({str(tmp_path)!r}, inputs)))\n"
    )
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    memory = json.loads(run.stdout)
    whole = sum(p.numel() * p.element_size() for p in DeepseekV41.without_weights(cfg).parameters())
    bound = memory["own"] + memory["largest"] + 4 * 2**20
    assert memory["peak"] <= bound, memory
    assert memory["own"] < whole / 4 and bound < whole / 3, (memory, whole)
