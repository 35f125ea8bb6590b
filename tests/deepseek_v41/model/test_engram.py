"""Engram against the facts of the official V4.1 inference code (the primes, multipliers and
row ids it computes, its gate), its n-gram history across calls, the compressed token map read
with `tokenizers`, and the errors of a config, a tokenizer or a checkpoint that do not fit."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models

from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig, load_checkpoint
from dsv41_compile.deepseek_v41.model.checkpoint import INDEX, token_map
from dsv41_compile.deepseek_v41.model.engram import EngramHash, engram_gate
from dsv41_compile.deepseek_v41.model.ngram import (
    column_offsets,
    compressed_token_map,
    hash_multipliers,
)
from dsv41_compile.deepseek_v41.testing.batches import Request, incremental_schedule, pack
from dsv41_compile.deepseek_v41.testing.checkpoints import synthetic_checkpoint

FLASH = ModelConfig.from_name("flash")
TINY = ModelConfig.from_name("tiny")


def test_the_released_primes_offsets_and_multipliers():
    layer1, layer14 = FLASH.engram_primes
    assert (sum(layer1), sum(layer14)) == FLASH.engram_num_embeddings == (384006168, 384016682)
    assert layer1[:8] == (
        16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183,
    )  # fmt: skip
    assert (layer1[8], layer14[0], layer14[-1]) == (16000189, 16000477, 16000889)
    assert column_offsets(layer1)[:2] == (0, 16000057)
    assert column_offsets(layer1)[-1] + layer1[-1] == 384006168
    assert hash_multipliers((1, 14), 4, 99092) == (
        (76632096046245, 4839876093313, 35959672319349, 73987337458391),
        (67716810739261, 51510806800915, 30921347202721, 82619226485591),
    )


def flash_hash() -> EngramHash:
    """Flash's hash with the identity token map: the compressed ids are the token ids."""
    hashed = EngramHash(FLASH)
    hashed.token_map.data = torch.arange(FLASH.vocab_size)
    return hashed


def test_row_ids_of_hand_checked_ngrams_and_the_same_across_calls():
    """Ids 10, 20, 30, 40 of one request (pad id 2): the official code's row ids at t = 0 (every
    lookback pad) and at t = 3 (the whole 4-gram), whether t = 3 comes in the prefill or as a
    decode step after a 3-token prefill."""
    ids, positions, slots = torch.tensor([10, 20, 30, 40]), torch.arange(4), torch.zeros(4).long()
    hashed = flash_hash()
    history = [torch.zeros(2, dtype=torch.int64) for _ in range(3)]
    prefill = hashed(ids, positions, slots, slots, history)  # [L, T, C]
    assert prefill[0, 0, :4].tolist() == [9400104, 24924096, 42335591, 53627767]
    assert prefill[0, 3, :4].tolist() == [1326936, 22120929, 40011923, 55142539]
    assert prefill[1, 3, -3:].tolist() == [340293184, 357342800, 378588994]

    history = [torch.zeros(2, dtype=torch.int64) for _ in range(3)]
    hashed(ids[:3], positions[:3], slots[:3], slots[:3], history)
    assert [h[0].item() for h in history] == [30, 20, 10]  # the request's last ids
    decode = hashed(ids[3:], positions[3:], slots[3:], slots[3:], history)
    assert torch.equal(decode[:, 0], prefill[:, 3])
    assert [h[0].item() for h in history] == [40, 30, 20]


def test_the_gate_on_hand_made_streams():
    """One stream, D = 2: h = (3, 4), key = (1, 0), q * k weights 1. rsqrt(mean h^2) = 1 / sqrt(12.5),
    rsqrt(mean key^2) = sqrt(2), so dot = 3 * 2 / 5 / sqrt(2); gate = sigmoid(sign * sqrt |dot|)."""
    h = torch.tensor([[[3.0, 4.0]], [[-3.0, -4.0]], [[3e-4, 4e-4]]])
    key = torch.tensor([[[1.0, 0.0]]]).expand(3, 1, 2)
    gate = engram_gate(h, key, torch.ones(1, 2), eps=1e-20, clamp=1e-6)
    dot = 3 * 2 / 5 / math.sqrt(2)
    s = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = [s(math.sqrt(dot)), s(-math.sqrt(dot)), s(math.sqrt(dot))]
    # (the third: |dot| is the same, the stream's scale cancels in the normalised product)
    torch.testing.assert_close(gate[:, 0], torch.tensor(expected), atol=1e-6, rtol=1e-6)
    tiny = engram_gate(torch.zeros(1, 1, 2), key[:1], torch.ones(1, 2), eps=1e-20, clamp=1e-6)
    assert tiny.item() == pytest.approx(s(1e-3))  # |dot| = 0 clamped to 1e-6 before the sqrt


@pytest.mark.parametrize("step", [1, 3])
def test_prefill_equals_incremental_and_multi_token_decode(step):
    """tiny's Engram layer (layer 1) sees the same n-grams however a request arrives: requests
    longer than the n-gram window, split across calls one or three tokens at a time."""
    torch.manual_seed(0)
    model = DeepseekV41(TINY).eval()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (9, 6, 7)]
    with torch.inference_mode():
        whole_cache = model.new_cache(4, 32)
        whole = model(*pack([Request(i, p) for i, p in enumerate(prompts)]), whole_cache)
        cache = model.new_cache(4, 32)
        rows = {}
        for batch in incremental_schedule(prompts, prefill=[2, 1, 5], step=step):
            ids, positions, slots = pack(batch)
            logits = model(ids, positions, slots, cache)
            for s, p, row in zip(slots.tolist(), positions.tolist(), logits):
                rows[s, p] = row
    starts = [0, 9, 15]
    for i, prompt in enumerate(prompts):
        for p in range(len(prompt)):
            torch.testing.assert_close(rows[i, p], whole[starts[i] + p], atol=2e-5, rtol=2e-5)
    for a, b in zip(cache.ngram, whole_cache.ngram):
        assert torch.equal(a[:3], b[:3])  # the slots' histories (not the scratch slot)


def word_level(tokens: list[str], path) -> None:
    Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0])).save(
        str(path)
    )


def test_the_compressed_token_map_normalises_as_the_official_code(tmp_path):
    """Case, accents, Unicode forms and runs of whitespace collapse; a whitespace-only token
    keeps one space (not the empty key); first occurrence numbers the classes."""
    tokens = ["the", " The", "THE", "café", "cafe", "ﬁ", "fi", "\n\n", " ", "\t ", "x"]
    word_level(tokens, tmp_path / "tokenizer.json")
    assert compressed_token_map(tmp_path / "tokenizer.json") == (0, 0, 0, 1, 1, 2, 2, 3, 3, 3, 4)


def test_a_tokenizer_with_another_class_count_is_refused(tmp_path):
    word_level(["a", "A", "b"], tmp_path / "tokenizer.json")
    assert token_map(tmp_path, vocab_size=4, classes=2).tolist() == [0, 0, 1, 0]
    with pytest.raises(ValueError) as error:
        token_map(tmp_path, vocab_size=4, classes=3)
    assert str(error.value) == (
        f"{tmp_path / 'tokenizer.json'}: the tokenizer's compressed token map has 2 classes; "
        "the config's engram_compressed_vocab_size is 3: another tokenizer than the model's"
    )


def test_table_rows_that_the_primes_do_not_make_are_refused():
    with pytest.raises(ValueError) as error:
        ModelConfig.from_name("tiny", engram_num_embeddings=(385,))
    assert str(error.value) == (
        "engram_num_embeddings (385,) do not match the tables the hash primes make, (384,) "
        "(engram_vocab_size 50, 2 heads, orders 2..4)"
    )


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("engram_ckpt")
    synthetic_checkpoint(TINY, out, seed=3, files=2)
    return out


def test_a_missing_or_misshapen_engram_tensor_names_it(written, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(written, root)
    index = json.loads((root / INDEX).read_text())
    name = "layers.1.engram.embed.weight"
    shard = index["weight_map"][name]
    tensors = load_file(str(root / shard))
    tensors[name] = torch.zeros(383, 32).to(torch.float8_e4m3fn)  # a row short
    save_file(tensors, str(root / shard))
    with pytest.raises(ValueError) as error:
        load_checkpoint(DeepseekV41(TINY), root)
    assert str(error.value) == (
        f"{name} ({shard}): torch.float8_e4m3fn [383, 32], expected torch.float8_e4m3fn [384, 32]"
    )
    del tensors[name]
    save_file(tensors, str(root / shard))
    del index["weight_map"][name]
    (root / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"missing .*'layers\.1\.engram\.embed\.weight'"):
        load_checkpoint(DeepseekV41(TINY), root)


def test_a_checkpoint_without_its_tokenizer_is_refused(written, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(written, root)
    (root / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError) as error:
        load_checkpoint(DeepseekV41(TINY), root)
    assert str(error.value) == (
        f"{root / 'tokenizer.json'}: missing; the Engram layers hash token ids through the "
        "checkpoint's tokenizer (its compressed token map)"
    )


def test_a_config_without_the_class_count_names_it(written, tmp_path):
    """`read_weights` (the backend's per-rank read) checks the token map's class count against
    the checkpoint's config.json: a config without it is an error naming the key."""
    from dsv41_compile.deepseek_v41.model.checkpoint import read_weights
    from dsv41_compile.deepseek_v41.testing.checkpoints import rank_weight_inputs

    root = tmp_path / "ckpt"
    shutil.copytree(written, root)
    config = json.loads((root / "config.json").read_text())
    text = config.get("text_config", config)
    del text["engram_compressed_vocab_size"]
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        read_weights(root, rank_weight_inputs(TINY, {"tp": 4, "ep": 8}, 0))
    assert str(error.value) == (
        f"{root / 'config.json'}: no engram_compressed_vocab_size, which the Engram token map's "
        "class count is checked against; this checkpoint's model has Engram layers"
    )


def test_official_numerics_quantise_the_rows_into_wkv():
    """Under numerics="official", Engram's `wkv` (an FP8 GEMM in the official code) gets its
    input FP8 quantise-dequantised per 32 (`numerics.act_quant`), as the attention's FP8 GEMMs
    do. On looked-up rows the step is exact: a row's blocks of 32 are the table's, whose values
    are e4m3 codes times a power of two, so a power-of-two scale no larger than the table's
    keeps every value (a block whose largest magnitude is under the 1e-4 floor would not)."""
    from dsv41_compile.deepseek_v41.model.numerics import act_quant_dequant

    cfg = ModelConfig.from_name("tiny", dtype="bfloat16", numerics="official", index_head_dim=32)
    torch.manual_seed(0)
    engram = DeepseekV41(cfg).layers[1].engram
    assert engram.fp8_input
    x = torch.randn(5, cfg.hc_mult, cfg.dim, dtype=torch.bfloat16)
    bounds = engram.embed.columns
    rows = torch.stack([torch.randint(a, b, (5,)) for a, b in zip(bounds, bounds[1:])], 1)
    looked_up = engram.embed(rows, torch.bfloat16).flatten(1)
    assert torch.equal(act_quant_dequant(looked_up), looked_up)
    kv = engram.wkv(act_quant_dequant(looked_up))
    key, value = kv.split([cfg.hc_mult * cfg.dim, cfg.dim], dim=-1)
    gate = engram_gate(
        x.float(), key.float().unflatten(-1, (cfg.hc_mult, cfg.dim)),
        engram.q_weight.float() * engram.k_weight.float(), engram.eps, engram.clamp,
    )  # fmt: skip
    expected = (x.float() + gate[..., None] * value.float()[:, None, :]).to(x.dtype)
    assert torch.equal(engram(x, rows), expected)
