"""`weight_format="released"`: the FP8 linears and the FP4 routed experts held as the checkpoint
stores them (codes and e8m0 scales), decoded where they are used: the same logits as the
dequantised model loaded from the same checkpoint, bit for bit, for half (FP8) and about a
quarter (FP4) of the bytes in bf16; and what each rank of tp=4, ep=8 holds of them."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig, load_checkpoint
from dsv41_compile.deepseek_v41.model.checkpoint import INDEX, checkpoint_layout
from dsv41_compile.deepseek_v41.model.ops import (
    fp4_weight,
    fp8_weight,
    routed_experts,
    routed_experts_fp4,
)
from dsv41_compile.deepseek_v41.model.quant import (
    E2M1,
    dequantize_fp4,
    dequantize_fp8,
    quantize_fp4,
)
from dsv41_compile.deepseek_v41.model.released import Fp8Linear
from dsv41_compile.deepseek_v41.testing.batches import incremental_schedule, pack
from dsv41_compile.deepseek_v41.testing.checkpoints import rank_weight_inputs, synthetic_checkpoint

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


def test_an_fp8_weight_is_decoded_per_32_by_32_block_as_the_loader_decodes_it():
    # 40 x 70: short last blocks both ways; the four blocks scaled 2^-2, 2^0, 2^3, 2^-1
    codes = torch.randn(40, 70).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.tensor([[125, 127, 130], [126, 127, 127]], dtype=torch.uint8)
    scale = scale.view(torch.float8_e8m0fnu)
    got = fp8_weight(codes, scale, torch.float32)
    assert got[5, 40].item() == codes[5, 40].float().item() * 1.0
    assert got[5, 69].item() == codes[5, 69].float().item() * 8.0
    assert got[39, 3].item() == codes[39, 3].float().item() * 0.5
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(
            fp8_weight(codes, scale, dtype), dequantize_fp8(codes, scale, dtype, "w")
        )
    # the rows of a part made of whole blocks, with the scales of those blocks
    assert torch.equal(fp8_weight(codes[32:], scale[1:], torch.float32), got[32:])


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


def test_the_released_weights_are_the_stored_bytes(checkpoint):
    released = loaded(TINY.replace(weight_format="released"), checkpoint)
    dequantized = loaded(TINY, checkpoint)
    state = released.state_dict()
    experts = released.layers[0].ffn.experts
    assert experts.w1.dtype == torch.int8 and experts.w1_scale.dtype == torch.float8_e8m0fnu
    assert experts.w1.shape == (16, 32, 32) and experts.w1_scale.shape == (16, 32, 2)
    wq_b = released.layers[0].attn.wq_b  # [H*d, q_lora] = [256, 32]
    assert isinstance(wq_b, Fp8Linear) and wq_b.weight.dtype == torch.float8_e4m3fn
    assert wq_b.scale.dtype == torch.float8_e8m0fnu and wq_b.scale.shape == (8, 1)
    # the parameters hold the checkpoint's tensors as stored, expert by expert
    layout = checkpoint_layout(released)
    index = json.loads((checkpoint / INDEX).read_text())
    names = (
        *("layers.2.ffn.experts.5.w2.weight", "layers.2.ffn.experts.5.w2.scale"),
        *("layers.3.attn.wo_a.weight", "layers.3.attn.wo_a.scale"),
        *("layers.4.ffn.shared_experts.w1.weight", "layers.4.ffn.shared_experts.w1.scale"),
    )
    for name in names:
        entry = layout[name]
        with safe_open(str(checkpoint / index["weight_map"][name]), "pt") as f:
            stored = f.get_tensor(name)
        assert torch.equal(
            entry.part_of(state[entry.param]).view(torch.uint8), stored.view(torch.uint8)
        )

    def weight_bytes(model, part):
        return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if part in n)

    # 4 bits and an e8m0 byte per 32 inputs (17/32 of a byte), against 2 bytes in bf16
    assert weight_bytes(released, ".experts.") * 64 == weight_bytes(dequantized, ".experts.") * 17
    # a byte per value and one per 32 x 32 block (whole blocks here), against 2 bytes
    assert weight_bytes(released, ".wq_b.") * 2048 == weight_bytes(dequantized, ".wq_b.") * 1025


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


def test_each_rank_holds_the_stored_bytes_of_its_share_of_the_quantised_weights(checkpoint):
    """tp=4, ep=8 (tiny with 4 x 32 output groups, whole 32-blocks per rank): the bytes each rank
    holds of the FP8 and FP4 weights and their scales (the slices the backend's `checkpoint`
    option reads) are the stored bytes of its share -- the checkpoint's, counted from the files'
    headers: a quarter of a tp-split weight, an eighth of the experts, the rows of its columns
    of the Engram table, all of a replicated one.
    (The fp32 head, norms and router are held wider than the bf16 they are stored in.)"""
    cfg = TINY.replace(weight_format="released", o_lora_rank=32)
    root = checkpoint.parent / "released_wide_groups"
    synthetic_checkpoint(cfg, root, seed=5)
    weight_map = json.loads((root / INDEX).read_text())["weight_map"]
    stored = {}
    for name, file in weight_map.items():
        with safe_open(str(root / file), "pt") as f:
            stored[name] = math.prod(f.get_slice(name).get_shape())  # a byte per element
    kept = ("e4m3", "e8m0", "fp4_codes")
    shapes = {w.fqn: w.shape for w in rank_weight_inputs(cfg, {"tp": 4, "ep": 8}, 0)}
    layout = {n: e for n, e in checkpoint_layout(shapes).items() if e.fmt in kept}
    assert {e.fmt for e in layout.values()} == set(kept)
    for rank in range(8):
        inputs = {w.fqn: w for w in rank_weight_inputs(cfg, {"tp": 4, "ep": 8}, rank)}
        held = want = 0
        for fqn, w in inputs.items():
            if any(e.param == fqn for e in layout.values()):
                size = math.prod(w.shape) * w.dtype.itemsize
                if w.slice is not None:
                    start, stop = w.slice.bounds(w.shape[w.slice.dim])
                    size = size * (stop - start) // w.shape[w.slice.dim]
                held += size
        for name, entry in layout.items():
            w = inputs[entry.param]
            if w.slice is None:
                want += stored[name]
            elif entry.expert is not None:
                start, stop = w.slice.bounds(w.shape[0])
                want += stored[name] if start <= entry.expert < stop else 0
            else:  # a tp shard, or the rows of the Engram table's columns this rank holds
                start, stop = w.slice.bounds(w.shape[w.slice.dim])
                want += stored[name] * (stop - start) // w.shape[w.slice.dim]
        assert held == want, rank


def test_a_tp_split_through_fp8_blocks_is_refused_naming_the_weight():
    """tiny's wo_a has 4 x 16 output rows: over tp=4, 16 rows per rank, half a block of its
    scales. Planning says so (what the backend's compile calls)."""
    with pytest.raises(ValueError) as error:
        rank_weight_inputs(TINY.replace(weight_format="released"), {"tp": 4, "ep": 8}, 0)
    assert str(error.value) == (
        "weight_format='released': layers.0.attn.wo_a.weight [64, 64] is split over tp=4 "
        "along dim 0, 16 per rank: not whole 32-wide blocks of its FP8 scales. Use a tp that "
        "splits it in whole blocks, or a model with weight_format='dequantized'"
    )
