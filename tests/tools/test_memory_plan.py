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


def test_the_moe_transient_as_each_npu_lowering_hands_it_over(load_tool, plan_once):
    """`decoded_per_call` on the program npugraph_ex gets (tiny-swa, one layer, as released):
    under the official numerics the grouped matmul reads the FP4 experts as they are, and a
    MoE call makes nothing of them but w2's scales padded to pairs (tiny's hidden width holds
    one block of 32: an odd count); with a bf16 input the experts are decoded every call, w1,
    w2 and w3 of each local expert in bf16 (and the pad)."""
    from dsv41_compile.deepseek_v41.testing.presets import AS_RELEASED
    from dsv41_compile.testing.torchair_standin import register_npu_ops

    register_npu_ops()
    tool = load_tool("memory_plan")
    options = {"tp": 4, "ep": 8, "lowering": "npugraph_ex"}
    made = {}
    for numerics in ("official", "bf16"):
        cfg = compile_config("tiny-swa", ONE_LAYER, AS_RELEASED, (("numerics", numerics),))
        made[numerics] = tool.decoded_per_call(*plan_once(cfg, options, world_size=8)[:2])
    local, I, D = cfg.n_routed_experts // 8, cfg.moe_inter_dim, cfg.dim
    pad = local * D * 2  # w2's scales: one byte per row became a pair
    assert made["official"] == pad
    assert made["bf16"] == 3 * local * I * D * 2 + pad
