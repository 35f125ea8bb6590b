"""The official numerics: the FP8 / FP4 activation formats against values computed by hand and
against the checkpoint's own decoders, the official attention kernel's rounding, and the
single-device model under `numerics="official"` (prefill == decode, and no step a no-op)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig
from dsv41_compile.deepseek_v41.model.attention import blockwise_sink_attention, sink_attention
from dsv41_compile.deepseek_v41.model.config import Rounding
from dsv41_compile.deepseek_v41.model.numerics import (
    act_dequant,
    act_quant,
    act_quant_dequant,
    fp4_dequant,
    fp4_quant,
    fp4_quant_dequant,
    fp4_rows,
    fp8_rows,
    from_fp4_rows,
    from_fp8_rows,
)
from dsv41_compile.deepseek_v41.model.ops import routed_experts
from dsv41_compile.deepseek_v41.model.quant import dequantize_fp4, dequantize_fp8
from dsv41_compile.deepseek_v41.testing.batches import Request, incremental_schedule, pack

STEPS = [f.name for f in dataclasses.fields(Rounding)]
COMPRESSED_STEPS = ("compressed_kv", "index_q", "index_k", "index_scores")
"""The steps that act in compressed attention only (tiny's layers 2-7)."""


# (These tests run on one intra-op thread, as every test does: tests/conftest.py.)


def bf16(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bfloat16)


def padded_to(n: int, *values: float) -> torch.Tensor:
    """`values` then zeros: a block of n."""
    return torch.cat((bf16(*values), torch.zeros(n - len(values), dtype=torch.bfloat16)))


def exponent_bytes(scale: torch.Tensor) -> list[int]:
    return scale.view(torch.uint8).tolist()


# --- FP8 activations (act_quant) --------------------------------------------------------------


def test_fp8_scale_is_the_power_of_two_above_amax_over_448_and_codes_round_to_even():
    # amax 2.5: 2.5 / 448 = 2^-7.5, so s = 2^-7 (e8m0 byte 120)
    x = padded_to(32, 2.5, 1.0, -0.3, 0.001, 17 / 128, 19 / 128)
    codes, scales = act_quant(x)
    assert exponent_bytes(scales) == [127 - 7]
    # 2.5 * 128 = 320; 1 -> 128; bf16(-0.3) * 128 = -38.5 -> -40 (e4m3 steps of 4 in [32, 64));
    # bf16(0.001) * 128 = 0.1279 -> 0.125 (steps of 2^-6 in [2^-3, 2^-2)); 17 and 19 are ties
    # between steps of 2 in [16, 32): to the even mantissa, 16 and 20
    assert codes.float()[:6].tolist() == [320, 128, -40, 0.125, 16, 20]
    assert act_quant_dequant(x)[:6].tolist() == [2.5, 1.0, -0.3125, 2.0**-10, 0.125, 0.15625]
    assert torch.equal(act_dequant(codes, scales), act_quant_dequant(x))


def test_fp8_amax_just_above_448_times_a_power_of_two_doubles_the_scale():
    codes, scales = act_quant(torch.cat((padded_to(32, 448.0), padded_to(32, 450.0))))
    assert exponent_bytes(scales) == [127, 128]  # 448 / 448 = 1 exactly; 450 / 448 > 1
    assert codes.float()[[0, 32]].tolist() == [448, 224]  # 450 / 2 = 225 -> 224 (steps of 16)


def test_fp8_amax_floor_of_1e_minus_4():
    # An all-zero block and one of amax 2^-16 both take s = 2^ceil(log2(1e-4 / 448)) = 2^-22.
    x = torch.cat((padded_to(32), padded_to(32, 2.0**-16, 3 * 2.0**-32)))
    codes, scales = act_quant(x)
    assert exponent_bytes(scales) == [127 - 22, 127 - 22]
    # 3 * 2^-32 / 2^-22 = 1.5 * 2^-9, a tie between e4m3's subnormals 2^-9 and 2^-8: to the
    # even one, 2^-8, so it comes back as 2^-30 (without the floor, s = 2^-24 keeps it exact)
    assert codes.float()[33].item() == 2.0**-8
    assert act_quant_dequant(x)[[0, 32, 33]].tolist() == [0.0, 2.0**-16, 2.0**-30]


# --- FP4 e2m1: e4m3 scales per 16 (compressed KV), e8m0 scales per 32 (indexer) --------------


def test_fp4_with_e4m3_scales_per_16_rounds_to_nearest_even():
    grid = (6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -5, 0.1, 5.5, -1.75, 4.5, 3, 0)
    x = torch.cat(
        (
            bf16(*grid),  # amax 6: s = e4m3(6 / 6) = 1, the values are their own codes
            padded_to(16, 9.0, 4.5, 2.0),  # s = e4m3(1.5) = 1.5: not a power of two
            padded_to(16, 6.3, 1.0),  # s = e4m3(6.3125 / 6 = 1.052) = 1, below amax / 6
            padded_to(16),  # floor 6 * 2^-9: s = 2^-9, e4m3's least subnormal
        )
    )
    packed, scales = fp4_quant(x, 16, "e4m3")
    assert scales.float().tolist() == [1.0, 1.5, 1.0, 2.0**-9]
    got = fp4_quant_dequant(x, 16, "e4m3")
    # ties 0.25, 1.25, 2.5, 5 go down, 0.75, 1.75, 3.5 up: to the even code
    assert got[:16].tolist() == [6, 0, 1, 1, 2, 2, 4, 4, -0.0, -4, 0, 6, -2, 4, 3, 0]
    assert torch.signbit(got[8])  # -0.25 -> -0: the sign of zero is kept
    # 9 / 1.5 = 6, 4.5 / 1.5 = 3, 2 / 1.5 = 1.33 -> 1.5, times 1.5
    assert got[16:19].tolist() == [9.0, 4.5, 2.25]
    # 6.3125 / 1 saturates at 6 (the e4m3 scale rounded below amax / 6)
    assert got[32:34].tolist() == [6.0, 1.0]
    assert torch.equal(fp4_dequant(packed, scales), got)
    assert packed.dtype == torch.uint8 and packed.shape == (32,)


def test_fp4_e4m3_scale_saturates_at_448():
    x = padded_to(16, 4096.0, -4096.0)  # 4096 / 6 = 682.7 > 448: s = 448, not NaN
    _, scales = fp4_quant(x, 16, "e4m3")
    assert scales.float().tolist() == [448.0]
    assert fp4_quant_dequant(x, 16, "e4m3")[:2].tolist() == [6 * 448.0, -6 * 448.0]


def test_fp4_with_e8m0_scales_per_32():
    x = torch.cat((padded_to(32, 6.0, 0.75), padded_to(32, 6.0625, 5.0), padded_to(32)))
    _, scales = fp4_quant(x, 32, "e8m0")
    # 6 / 6 = 1 exactly: s = 1; 6.0625 / 6 > 1: s = 2; zeros: the floor 6 * 2^-126 gives 2^-126
    assert exponent_bytes(scales) == [127, 128, 1]
    got = fp4_quant_dequant(x, 32, "e8m0")
    assert got[[0, 1, 32, 33]].tolist() == [6.0, 1.0, 6.0, 4.0]  # 6.0625/2 -> 3; 5/2 = 2.5 -> 2


# --- through the checkpoint's own bytes -------------------------------------------------------


def test_round_trips_through_the_checkpoint_decoders_and_the_cache_rows():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 64, generator=gen) * torch.logspace(-6, 3, 6)[:, None]).bfloat16()
    x[0, :32] = 0.0

    # FP4 with e8m0 scales per 32 is the released FP4 weight format, byte for byte
    packed, scales = fp4_quant(x, 32, "e8m0")
    weight = dequantize_fp4(packed.view(torch.int8), scales, torch.bfloat16, "x")
    assert torch.equal(weight, fp4_quant_dequant(x, 32, "e8m0"))
    # FP8 codes and scales of a row are a one-row FP8 weight (its scale [1, n / 32])
    codes, scales = act_quant(x)
    rows = [
        dequantize_fp8(codes[i : i + 1], scales[i : i + 1], torch.bfloat16, "x") for i in range(6)
    ]
    assert torch.equal(torch.cat(rows), act_quant_dequant(x))

    # the cache rows hold the same values, in n + n/32 and n/2 + n/16 bytes
    assert fp8_rows(x).shape == (6, 66) and fp4_rows(x).shape == (6, 36)
    assert torch.equal(from_fp8_rows(fp8_rows(x)), act_quant_dequant(x))
    assert torch.equal(from_fp4_rows(fp4_rows(x)), fp4_quant_dequant(x, 16, "e4m3"))
    # a dequantised tensor quantises to itself
    for qdq in (
        act_quant_dequant,
        lambda t: fp4_quant_dequant(t, 16, "e4m3"),
        lambda t: fp4_quant_dequant(t, 32, "e8m0"),
    ):
        assert torch.equal(qdq(qdq(x)), qdq(x))


def test_the_formats_take_bf16_in_whole_blocks():
    with pytest.raises(ValueError, match="takes bf16, got torch.float32"):
        act_quant(torch.zeros(32))
    with pytest.raises(ValueError, match="a last dim of 48 is not a whole number of 32-blocks"):
        fp4_quant(torch.zeros(48, dtype=torch.bfloat16), 32, "e8m0")


# --- attention probabilities in bf16, as the official kernel rounds them ----------------------


def online_sink_attention(q, kv, visible, sink):
    """The official kernel's loop, one block of 64 keys at a time: an independent reference
    for `blockwise_sink_attention`."""
    T, H, d = q.shape
    acc, total = torch.zeros(T, H, d), torch.zeros(T, H)
    running = torch.full((T, H), -1e30)
    for start in range(0, kv.shape[1], 64):
        keys, seen = kv[:, start : start + 64].float(), visible[:, start : start + 64]
        s = torch.einsum("thd,tkd->thk", q.float(), keys) * d**-0.5
        s = s.masked_fill(~seen[:, None], float("-inf"))
        previous, running = running, torch.maximum(running, s.amax(-1))
        p = torch.exp(s - running[..., None])
        total = total * torch.exp(previous - running) + p.sum(-1)
        acc = acc * torch.exp(previous - running)[..., None] + torch.einsum(
            "thk,tkd->thd", p.bfloat16().float(), keys
        )
    return acc / (total + torch.exp(sink - running))[..., None]


def test_blockwise_attention_is_the_kernels_online_softmax_with_bf16_probabilities():
    gen = torch.Generator().manual_seed(1)
    T, H, S, d = 3, 4, 150, 16  # three blocks, the last one short
    q, kv = torch.randn(T, H, d, generator=gen) * 2, torch.randn(T, S, d, generator=gen)
    visible = torch.rand(T, S, generator=gen) > 0.2
    visible[0, :64] = False  # a first block with nothing visible
    sink = torch.randn(H, generator=gen)
    got = blockwise_sink_attention(q, kv, visible, sink)
    torch.testing.assert_close(got, online_sink_attention(q, kv, visible, sink))
    # the bf16 probabilities move the result off the fp32 softmax, and (rounded against the
    # running max) with the order of the keys, which the fp32 softmax ignores
    assert not torch.allclose(got, sink_attention(q, kv, visible, sink), rtol=1e-5, atol=1e-6)
    order = torch.arange(S - 1, -1, -1)
    reversed_keys = blockwise_sink_attention(q, kv[:, order], visible[:, order], sink)
    assert not torch.allclose(got, reversed_keys, rtol=1e-5, atol=1e-6)


# --- the model under numerics="official" ------------------------------------------------------


def official(preset: str, **overrides: object) -> ModelConfig:
    """`preset` with the official numerics: bf16, and index heads of 32 (tiny's 16 is not a
    whole FP4 block of the indexer)."""
    return ModelConfig.from_name(
        preset, dtype="bfloat16", numerics="official", index_head_dim=32, **overrides
    )


def test_the_config_says_what_official_needs():
    cases = [
        ({"numerics": "fp8"}, "numerics must be one of .'bf16', 'official'., got 'fp8'"),
        ({"numerics": "official"}, "use dtype='bfloat16' .got 'float32'., or numerics='bf16'"),
        (
            {"numerics": "official", "dtype": "bfloat16"},
            r"blocks of 32: index_head_dim \(16\) must be a multiple of 32, or use numerics='bf16'",
        ),
        ({"numerics_off": ("window_kv",)}, "leaves out steps of numerics='official'"),
        (
            {"numerics": "official", "dtype": "bfloat16", "numerics_off": ("kv",)},
            r"unknown steps \['kv'\]",
        ),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_name("tiny", **overrides)
    # a window-only model has no indexer: its index_head_dim is not quantised
    assert ModelConfig.from_name("tiny-swa", dtype="bfloat16", numerics="official").rounding == (
        Rounding.of("official")
    )
    assert not any(dataclasses.astuple(ModelConfig.from_name("tiny").rounding))


def test_the_head_is_fp32_in_both_numerics():
    for cfg in (ModelConfig.from_name("tiny-swa", dtype="bfloat16"), official("tiny-swa")):
        model = DeepseekV41(cfg)
        assert model.state_dict()["head.weight"].dtype == torch.float32
        assert model.embed.weight.dtype == torch.bfloat16
        with torch.inference_mode():
            logits = model(*pack([Request(0, [1, 2, 3])]), model.new_cache(1, 4))
        assert logits.dtype == torch.float32


@pytest.fixture(scope="module")
def tiny() -> DeepseekV41:
    torch.manual_seed(0)
    return DeepseekV41(official("tiny")).eval()


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]


ROWS = 16
"""Rows of every call in the prefill == decode test: the CPU BLAS computes an fp32 GEMM of
fewer rows with other kernels, in another summation order (a few fp32 ulps), which an FP8 or
FP4 rounding downstream can turn into a whole code step. Padding rows change nothing (the model's
contract), and with them every call runs on the prefill's kernels: what is compared is the
numerics, bit for bit."""


def logits_by_token(model: DeepseekV41, cache, requests: list[Request]) -> dict:
    rows = sum(len(r.ids) for r in requests)
    requests = requests + [Request(-1, [0] * (ROWS - rows))] if rows < ROWS else requests
    ids, positions, slots = pack(requests)
    with torch.inference_mode():
        logits = model(ids, positions, slots, cache)
    return {(s, p): row for s, p, row in zip(slots.tolist(), positions.tolist(), logits) if s >= 0}


@pytest.mark.parametrize("preset", ["tiny", "tiny-swa"])
def test_prefill_equals_decode_and_multi_token_decode_bit_for_bit(
    preset: str, tiny: DeepseekV41
) -> None:
    torch.manual_seed(0)
    model = tiny if preset == "tiny" else DeepseekV41(official(preset)).eval()
    # As test_compressed_attention's: top-k and candidates prune, ratio-2 pairs split across calls
    reqs = prompts([21, 14, 18], seed=7)
    full_cache = model.new_cache(3, 32)
    full = logits_by_token(model, full_cache, [Request(s, p) for s, p in enumerate(reqs)])
    for step in (1, 3):
        cache = model.new_cache(3, 32)
        got = {}
        for batch in incremental_schedule(reqs, prefill=[3, 1, 6], step=step):
            got |= logits_by_token(model, cache, batch)
        assert got.keys() == full.keys()
        assert all(torch.equal(got[k], full[k]) for k in full), f"step {step}"
        # the caches hold FP8 window rows and FP4 compressed rows, the same bytes either way
        # (pair_state keeps a stale opener where a pair closed in a later call: never read)
        for field in ("window_kv", "compressed_kv", "index_k"):
            held, full_held = getattr(cache, field), getattr(full_cache, field)
            keys = range(len(held)) if isinstance(held, list) else held.keys()
            assert all(torch.equal(held[k][:3], full_held[k][:3]) for k in keys), field
    d = model.cfg.head_dim
    assert full_cache.window_kv[0].dtype == torch.uint8
    assert full_cache.window_kv[0].shape == (4, model.cfg.window_size, d + d // 32)
    for layer, entries in full_cache.compressed_kv.items():
        assert entries.dtype == torch.uint8 and entries.shape[-1] == d // 2 + d // 16, layer


def test_a_request_does_not_depend_on_its_batch(tiny: DeepseekV41) -> None:
    # the official roundings are per token: what the compiler's token sharding relies on
    reqs = prompts([9, 7], seed=3)
    both = logits_by_token(tiny, tiny.new_cache(2, 16), [Request(0, reqs[0]), Request(1, reqs[1])])
    alone = logits_by_token(tiny, tiny.new_cache(2, 16), [Request(1, reqs[1])])
    assert all(torch.equal(alone[k], both[k]) for k in alone)


def test_routed_experts_quantise_the_hidden_activation_per_row():
    gen = torch.Generator().manual_seed(2)
    T, D, I, E, K = 12, 64, 32, 4, 2
    x = act_quant_dequant(torch.randn(T, D, generator=gen).bfloat16())
    idx = torch.randint(0, E, (T, K), generator=gen)
    idx[:, 1] = (idx[:, 0] + 1) % E
    weight = torch.rand(T, K, generator=gen)
    w1, w3 = (torch.randn(E, I, D, generator=gen).bfloat16() / 8 for _ in range(2))
    w2 = torch.randn(E, D, I, generator=gen).bfloat16() / 6
    out = routed_experts(x, idx, weight, w1, w2, w3, 10.0, True)
    assert not torch.equal(out, routed_experts(x, idx, weight, w1, w2, w3, 10.0))
    # rows in other groupings (what expert parallelism sends each rank) give the same rows
    for rows in (torch.arange(5), torch.arange(5, 12).flip(0)):
        part = routed_experts(x[rows], idx[rows], weight[rows], w1, w2, w3, 10.0, True)
        assert torch.equal(part, out[rows])


def test_no_step_of_the_official_numerics_is_a_no_op(tiny: DeepseekV41) -> None:
    # Long enough that the bf16 index scores change some top-k picks of the fp32 scores.
    batch = [Request(s, p) for s, p in enumerate(prompts([32, 32, 32], seed=7))]

    def run(cfg: ModelConfig) -> tuple[list[torch.Tensor], torch.Tensor]:
        model = DeepseekV41(cfg).eval()
        model.load_state_dict(tiny.state_dict())
        streams: list[torch.Tensor] = []
        for layer in model.layers:
            layer.register_forward_hook(lambda m, args, out: streams.append(out[0].float()))
        with torch.inference_mode():
            logits = model(*pack(batch), model.new_cache(3, 32))
        return streams, logits

    def moved(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    streams, logits = run(tiny.cfg)
    header = f"{'without':<14}" + "".join(f"{f'L{i}':>8}" for i in range(8)) + "  logits"
    lines, first_moved, logits_moved = [header], {}, {}
    for step in STEPS:
        other_streams, other_logits = run(tiny.cfg.replace(numerics_off=(step,)))
        per_layer = [moved(a, b) for a, b in zip(other_streams, streams)]
        first_moved[step] = next((i for i, m in enumerate(per_layer) if m), None)
        logits_moved[step] = moved(other_logits, logits)
        line = "".join(f"{m:8.1e}" for m in per_layer)
        lines.append(f"{step:<14}{line}  {logits_moved[step]:.1e}")
    report = "\n".join(lines)
    print(f"relative change of each layer's streams and of the logits:\n{report}")
    # every step moves the logits; the compressed-attention ones not before layer 2 (the first
    # compressed layer), the others from layer 0 on
    assert all(logits_moved[step] > 0 for step in STEPS), report
    assert all(first_moved[s] >= 2 for s in COMPRESSED_STEPS), report
    assert all(first_moved[s] == 0 for s in STEPS if s not in COMPRESSED_STEPS), report
