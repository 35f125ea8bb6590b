"""`weight_format="released"`: the routed experts held as the checkpoint stores them (FP4 codes
and e8m0 scales), decoded inside the routed-experts op: the same logits as the dequantised
model loaded from the same checkpoint, bit for bit, for a quarter of the bytes."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from dsv41_compile.model import DeepseekV41, ModelConfig, load_checkpoint
from dsv41_compile.model.checkpoint import INDEX, checkpoint_layout
from dsv41_compile.model.ops import fp4_weight, routed_experts, routed_experts_fp4
from dsv41_compile.model.quant import E2M1, dequantize_fp4, quantize_fp4
from dsv41_compile.testing.batches import incremental_schedule, pack
from dsv41_compile.testing.checkpoints import rank_weight_inputs, synthetic_checkpoint

TINY = ModelConfig.from_name("tiny", dtype="bfloat16", numerics="official", index_head_dim=32)


def test_an_experts_weight_is_decoded_as_the_checkpoint_loader_decodes_it():
    # every code in the low and the high nibble, under scales 2^-3, 2^0 and 2^4
    codes = torch.tensor([(15 - k % 16) << 4 | k % 16 for k in range(48)], dtype=torch.uint8)
    packed = codes.view(torch.int8).reshape(3, 16)
    scale = torch.tensor([[124], [127], [131]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = fp4_weight(packed, scale, torch.float32)
    assert got[1, :4].tolist() == [E2M1[0], E2M1[15], E2M1[1], E2M1[14]]
    assert got[0, 2].item() == E2M1[1] / 8 and got[2, 2].item() == E2M1[1] * 16
    for dtype in (torch.float32, torch.bfloat16):
        want = dequantize_fp4(packed, scale, dtype, "w")
        assert torch.equal(fp4_weight(packed, scale, dtype), want)


def test_the_fp4_op_is_the_op_of_the_decoded_weights_bit_for_bit():
    torch.manual_seed(0)
    E, I, D, T, K = 4, 64, 32, 7, 2
    stacked = [
        quantize_fp4(torch.randn(E * rows, inputs)) for rows, inputs in ((I, D), (D, I), (I, D))
    ]
    weights = [(w.view(E, -1, w.shape[1]), s.view(E, -1, s.shape[1])) for w, s in stacked]
    decoded = [
        torch.stack([fp4_weight(w[e], s[e], torch.bfloat16) for e in range(E)]) for w, s in weights
    ]
    x = torch.randn(T, D, dtype=torch.bfloat16)
    idx = torch.randint(0, E, (T, K))
    idx[3] = -1  # a padding row routes nowhere
    weight = torch.rand(T, K)
    for fp8_hidden in (False, True):
        got = routed_experts_fp4(x, idx, weight, *sum(weights, ()), 10.0, fp8_hidden)
        want = routed_experts(x, idx, weight, *decoded, 10.0, fp8_hidden)
        assert torch.equal(got, want)
        assert got[3].abs().max() == 0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("released")
    synthetic_checkpoint(TINY.replace(weight_format="released"), out, seed=4)
    return out


def loaded(cfg: ModelConfig, path) -> DeepseekV41:
    model = DeepseekV41.without_weights(cfg)
    load_checkpoint(model, path)
    return model.eval()


def test_the_released_experts_are_the_stored_bytes_and_a_quarter_of_bf16(checkpoint):
    released = loaded(TINY.replace(weight_format="released"), checkpoint)
    dequantized = loaded(TINY, checkpoint)
    state = released.state_dict()
    experts = released.layers[0].ffn.experts
    assert experts.w1.dtype == torch.int8 and experts.w1_scale.dtype == torch.float8_e8m0fnu
    assert experts.w1.shape == (16, 32, 32) and experts.w1_scale.shape == (16, 32, 2)
    # the parameters hold the checkpoint's tensors as stored, expert by expert
    layout = checkpoint_layout(released)
    index = json.loads((checkpoint / INDEX).read_text())
    for name in ("layers.2.ffn.experts.5.w2.weight", "layers.2.ffn.experts.5.w2.scale"):
        entry = layout[name]
        with safe_open(str(checkpoint / index["weight_map"][name]), "pt") as f:
            stored = f.get_tensor(name)
        assert torch.equal(
            state[entry.param][entry.expert].view(torch.uint8), stored.view(torch.uint8)
        )

    def expert_bytes(model):
        return sum(
            p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n
        )

    # 4 bits and an e8m0 byte per 32 inputs (17/32 of a byte), against 2 bytes in bf16
    assert expert_bytes(released) * 64 == expert_bytes(dequantized) * 17


def test_released_and_dequantized_give_the_same_logits_bit_for_bit(checkpoint):
    """tiny (every attention mode) under the official numerics, from one checkpoint: the
    prefill and an incremental decode of the same requests, held both ways."""
    released = loaded(TINY.replace(weight_format="released"), checkpoint)
    dequantized = loaded(TINY, checkpoint)
    prompts = [list(range(1, 19)), list(range(20, 31))]
    cache_a, cache_b = released.new_cache(2, 32), dequantized.new_cache(2, 32)
    with torch.inference_mode():
        for step in incremental_schedule(prompts, [12, 5], 3):
            a = released(*pack(step), cache_a)
            assert torch.equal(a, dequantized(*pack(step), cache_b))
    for x, y in zip(cache_a.tensors(), cache_b.tensors()):
        assert torch.equal(x, y)


def test_the_config_says_what_released_needs():
    with pytest.raises(ValueError, match="weight_format must be one of"):
        TINY.replace(weight_format="fp4")
    with pytest.raises(ValueError, match=r"moe_inter_dim \(48\) must be multiples of 32"):
        TINY.replace(weight_format="released", numerics="bf16", moe_inter_dim=48)


def test_each_rank_holds_its_share_of_the_released_expert_bytes(checkpoint):
    """tp=4, ep=8: each rank's routed-expert weights (codes and scales, the slices the backend's
    `checkpoint` option reads) are an eighth of the checkpoint's, counted from the files'
    headers."""
    index = json.loads((checkpoint / INDEX).read_text())["weight_map"]
    released = 0
    for name, file in index.items():
        if ".ffn.experts." in name:
            with safe_open(str(checkpoint / file), "pt") as f:
                part = f.get_slice(name)
                released += math.prod(part.get_shape())  # int8 codes, e8m0 scales: a byte each
    cfg = TINY.replace(weight_format="released")
    for rank in range(8):
        held = 0
        for w in rank_weight_inputs(cfg, {"tp": 4, "ep": 8}, rank):
            if ".ffn.experts." in w.fqn:
                start, stop = w.slice.bounds(w.shape[0])
                held += (stop - start) * math.prod(w.shape[1:]) * w.dtype.itemsize
        assert held * 8 == released, rank
