"""tools/memory_plan.py against bytes counted by hand: tiny-swa (2 window-only layers) planned
as test_accounting plans it (the same memoised plan), rank 0 of tp=4, ep=8."""

from __future__ import annotations

from dsv41_compile.deepseek_v41.testing.presets import ENGRAM_0, ONE_LAYER, compile_config

F32 = 4


def test_weight_bytes_sharded_and_replicated_and_the_window_rings(load_tool, plan_once):
    cfg = compile_config()
    options = {"tp": 4, "ep": 8, "ep_dispatch": "padded", "layout": "sp", "lowering": "eager"}
    options["attn_exit"] = "reduce_scatter"  # wo_b row-parallel (the exit all-to-all: below)
    gm, ctx, model = plan_once(cfg, options, world_size=8, max_len=4096)
    report = load_tool("memory_plan").memory_plan(gm, ctx, max_len=4096)
    a2a = {**options, "attn_exit": "all_to_all"}
    a2a_report = load_tool("memory_plan").memory_plan(
        *plan_once(cfg, a2a, world_size=8, max_len=4096)[:2], max_len=4096
    )

    H, d, G, o, q = cfg.n_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank, cfg.q_lora_rank
    E, I, D = cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim
    # per layer: wq_b, the sink, wo_a by heads / groups over tp = 4; wo_b by its input columns;
    # the routed experts over ep = 8
    sharded = H * d // 4 * q + H // 4 + G * o // 4 * (H * d // G) + D * (G * o // 4)
    sharded += 3 * E // 8 * I * D
    sharded_full = H * d * q + H + G * o * (H * d // G) + D * G * o + 3 * E * I * D
    everything = sum(p.numel() for p in model.parameters())
    rope = sum(b.numel() for n, b in model.named_buffers() if n.endswith("rope_inv_freq"))
    assert report["weights"] == {
        "float32": {
            "sharded": cfg.n_layers * sharded * F32,
            "replicated": (everything - cfg.n_layers * sharded_full + rope) * F32,
        }
    }
    # the exit all-to-all keeps all of wo_b on every rank: 3/4 of it more per layer
    extra = cfg.n_layers * D * G * o * 3 // 4 * F32
    assert a2a_report["weights"]["float32"]["replicated"] == (
        report["weights"]["float32"]["replicated"] + cfg.n_layers * D * G * o * F32
    )
    assert a2a_report["weights"]["float32"]["sharded"] == (
        report["weights"]["float32"]["sharded"] - (cfg.n_layers * D * G * o * F32 - extra)
    )
    # window-only: per request, a ring of `window` fp32 latents of head_dim per layer, whatever
    # the length; nothing grows with it
    assert report["cache_fixed_per_request"] == cfg.n_layers * cfg.window_size * cfg.head_dim * F32
    assert report["cache_per_token"] == 0


def test_engram_tables_on_the_device_or_in_host_memory(load_tool, plan_once):
    """The plans of test_accounting's exchange test: tiny-swa's one layer with an Engram layer
    (384 rows of 32 e4m3 codes and one e8m0 scale, 6 columns of a prime's rows each): replicated
    on every rank, or one column per rank (ranks 0..5), padded to the longest, on the device or
    in host memory."""
    cfg = compile_config("tiny-swa", ONE_LAYER, ENGRAM_0)
    options = {"tp": 4, "ep": 8, "ep_dispatch": "padded", "lowering": "eager"}
    tool, row = load_tool("memory_plan"), 32 + 1
    tables = {}
    for engram in ("replicated", "sharded", "host"):
        gm, ctx, model = plan_once(cfg, {**options, "engram": engram}, world_size=8, max_len=64)
        tables[engram] = tool.memory_plan(gm, ctx, max_len=64)["engram_tables"]
    bounds = model.layers[0].engram.embed.columns
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    assert bounds[-1] == 384 and len(bounds) == 7
    assert tables == {
        "replicated": {"device": 384 * row, "host": 0},
        "sharded": {"device": longest * row, "host": 0},
        "host": {"device": 0, "host": longest * row},
    }
