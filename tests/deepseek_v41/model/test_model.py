"""The model's forward contract: ragged packing, prefill == decode == multi-token decode,
padding rows, dtypes, and compiling with plain inductor."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config
from torch._dynamo.testing import CompileCounterWithBackend

from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig
from dsv41_compile.deepseek_v41.testing.batches import Request, incremental_schedule, pack
from dsv41_compile.deepseek_v41.testing.presets import EVERY_MODE_5, compile_config

FP32_TOL = {"atol": 2e-5, "rtol": 2e-5}


@pytest.fixture(scope="module")
def model() -> DeepseekV41:
    torch.manual_seed(0)
    return DeepseekV41(ModelConfig.from_name("tiny")).eval()


# What the compile tests below trace: tiny's every-mode layers with 3 Sinkhorn iterations.
@pytest.fixture(scope="module")
def every_mode_model() -> DeepseekV41:
    torch.manual_seed(0)
    return DeepseekV41(compile_config("tiny", EVERY_MODE_5)).eval()


def random_prompts(lengths: list[int], vocab: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def run(model: DeepseekV41, cache, requests: list[Request]) -> torch.Tensor:
    with torch.inference_mode():
        return model(*pack(requests), cache)


def test_ragged_batch_equals_each_request_alone(model: DeepseekV41) -> None:
    # Long enough that every compressed mode of "tiny" prunes (see test_compressed_attention).
    prompts = random_prompts([13, 1, 19, 6], model.cfg.vocab_size)
    packed = run(model, model.new_cache(4, 32), [Request(s, p) for s, p in enumerate(prompts)])

    alone = [run(model, model.new_cache(1, 32), [Request(0, p)]) for p in prompts]
    torch.testing.assert_close(packed, torch.cat(alone), **FP32_TOL)


def run_by_token(model: DeepseekV41, cache, requests: list[Request]) -> dict:
    """Logits of one batch keyed by (slot, position)."""
    ids, positions, slots = pack(requests)
    with torch.inference_mode():
        logits = model(ids, positions, slots, cache)
    return {(s, p): row for s, p, row in zip(slots.tolist(), positions.tolist(), logits)}


@pytest.mark.parametrize("step", [1, 3], ids=["decode", "multi_token_decode"])
def test_incremental_equals_one_prefill(step: int) -> None:
    # Window-only layers; requests longer than the window (4), prefilled to different lengths.
    # The compressed modes have the same test in test_compressed_attention.py.
    torch.manual_seed(0)
    model = DeepseekV41(ModelConfig.from_name("tiny-swa")).eval()
    prompts = random_prompts([11, 7, 10], model.cfg.vocab_size, seed=2)
    full_cache = model.new_cache(3, 16)
    full = run_by_token(model, full_cache, [Request(s, p) for s, p in enumerate(prompts)])

    cache = model.new_cache(3, 16)
    got = {}
    for batch in incremental_schedule(prompts, prefill=[2, 1, 5], step=step):
        got |= run_by_token(model, cache, batch)

    assert got.keys() == full.keys()
    keys = sorted(full)
    torch.testing.assert_close(
        torch.stack([got[k] for k in keys]), torch.stack([full[k] for k in keys]), **FP32_TOL
    )
    assert cache.lengths.tolist() == [len(p) for p in prompts]
    # The window cache is a ring of `window` rows per request, whatever max_len: both ways of
    # filling it leave each request's last 4 positions in it.
    for ring, full_ring in zip(cache.window_kv, full_cache.window_kv):
        assert ring.shape == (4, model.cfg.window_size, model.cfg.head_dim)
        torch.testing.assert_close(ring[:3], full_ring[:3], **FP32_TOL)


def test_padding_rows_change_nothing_and_write_nothing(model: DeepseekV41) -> None:
    prompts = random_prompts([11, 16], model.cfg.vocab_size, seed=3)
    clean_cache = model.new_cache(2, 32)
    clean = run(model, clean_cache, [Request(0, prompts[0]), Request(1, prompts[1])])

    padded_cache = model.new_cache(2, 32)
    pad = [7, 8, 9]
    padded = run(
        model,
        padded_cache,
        [Request(-1, pad), Request(0, prompts[0]), Request(-1, pad[:1]), Request(1, prompts[1])],
    )
    valid = torch.tensor([False] * 3 + [True] * 11 + [False] + [True] * 16)
    torch.testing.assert_close(padded[valid], clean, **FP32_TOL)
    assert torch.count_nonzero(padded[~valid]) == 0
    assert padded_cache.lengths.tolist() == clean_cache.lengths.tolist()
    real_slots = slice(0, padded_cache.num_slots)
    for field in ("window_kv", "compressed_kv", "index_k", "pair_state"):
        clean_state, padded_state = getattr(clean_cache, field), getattr(padded_cache, field)
        keys = range(len(clean_state)) if isinstance(clean_state, list) else clean_state.keys()
        for key in keys:
            torch.testing.assert_close(
                padded_state[key][real_slots], clean_state[key][real_slots], **FP32_TOL
            )


@pytest.mark.parametrize(("preset", "max_rel_err"), [("tiny-swa", 0.02), ("tiny", 0.25)])
def test_bf16_runs_with_fp32_islands(preset: str, max_rel_err: float) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig.from_name(preset, dtype="bfloat16")
    model = DeepseekV41(cfg).eval()
    assert model.embed.weight.dtype == torch.bfloat16
    assert model.layers[0].attn.wq_b.weight.dtype == torch.bfloat16
    assert model.layers[0].ffn.experts.w1.dtype == torch.bfloat16
    for fp32_param in ("hc_attn.fn", "attn_norm.weight", "ffn.gate.weight", "attn.attn_sink"):
        assert model.layers[0].get_parameter(fp32_param).dtype == torch.float32
    assert model.head.weight.dtype == torch.float32  # as the official head: fp32 logits

    reference = DeepseekV41(cfg.replace(dtype="float32")).eval()
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    prompts = random_prompts([6, 3], cfg.vocab_size, seed=4)
    batch = [Request(0, prompts[0]), Request(1, prompts[1])]
    logits = run(model, model.new_cache(2, 8), batch)
    expected = run(reference, reference.new_cache(2, 8), batch)
    assert logits.dtype == torch.float32 and logits.isfinite().all()
    # bf16 activations against fp32 activations on the same (bf16-representable) weights. With
    # compressed layers the error is larger: bf16 rounding flips some indexer top-k picks.
    rel_err = (logits - expected).norm() / expected.norm()
    assert rel_err < max_rel_err, f"bf16 vs fp32 relative error {rel_err:.3f}"


def test_one_inductor_graph_serves_every_token_count(every_mode_model: DeepseekV41) -> None:
    """Plain inductor, `fullgraph=True`, `dynamic=True`: the model compiles as one graph that
    matches eager and, after the first call, serves T = 3, 8, 13, 5, 2 without recompiling
    (T = 1 is specialised by Dynamo itself). The backend relies on this. AOT tracing adds shape
    guards of its own (a [T-1] slice once made T=2 recompile after T=3), so trace through it.
    The first call traces once: no float of the model sends Dynamo back to trace it again with
    the float specialised (`layers.StaticFloat`); the backend would be called twice. The
    compiled calls run without inference_mode / no_grad: the model is inference-only by
    construction."""
    model = every_mode_model
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    # Scalar C++ kernels: inductor's lowering of every op is what this checks (its vectorised
    # code runs in the 8-rank inductor run of tests/distributed/test_numerics.py); the vector
    # code of some 50 kernels would take a third of the test's time to compile.
    scalar = torch._inductor.config.patch({"cpp.vec_isa_ok": False})
    compiled = torch.compile(model, backend=counter, dynamic=True, fullgraph=True)
    cache, reference_cache = model.new_cache(4, 64), model.new_cache(4, 64)
    held = [0, 0, 0, 0]
    gen = torch.Generator().manual_seed(6)
    compiles_after_first_call = None
    for T in (3, 8, 13, 5, 2):
        per_slot = [T // 4 + (s < T % 4) for s in range(4)]
        batch = []
        for s, n in enumerate(per_slot):
            if n:
                batch.append(
                    Request(s, torch.randint(0, 512, (n,), generator=gen).tolist(), held[s])
                )
                held[s] += n
        with scalar:
            got = compiled(*pack(batch), cache)
        with torch.inference_mode():
            want = model(*pack(batch), reference_cache)
        torch.testing.assert_close(got, want, **FP32_TOL)
        if compiles_after_first_call is None:
            compiles_after_first_call = counter.frame_count
    assert compiles_after_first_call == 1
    assert counter.frame_count == compiles_after_first_call
