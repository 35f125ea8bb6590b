"""tools/torchair_coverage.py against torch-npu 2.13.0's torchair source (downloaded once into
~/.cache, never installed; skipped with pip's reason when the package registry cannot be
reached: the tests that read it are marked `registry`).

Each graph the suite hands torchair is checked against its converters once, where it is made:
tests/targets/test_torchair.py (tiny-swa, sp, ep=8 padded, one fake rank),
tests/distributed/test_numerics.py (tiny on one rank, every attention mode; tiny-swa
replicated, ep=8 padded on 8 ranks); here, the tool's own pipeline on the one configuration no
run hands over (sp, ep=1: the routed experts whole on every rank, through the grouped matmul),
as released too (`--released`: FP4 experts, FP8 linears, the official numerics), and its
reading of the registry."""

from __future__ import annotations

from collections import Counter

from dsv41_compile.deepseek_v41.testing.presets import ONE_LAYER, compile_config


def test_scan_tells_real_converters_from_stubs(torchair_registry):
    _, registry = torchair_registry
    aten = "torch.ops.aten."
    assert registry.status(aten + "mm.default") is None
    assert registry.status(aten + "scatter.src") is None
    assert registry.status("torch.ops.npu.npu_grouped_matmul.default") is None
    assert registry.status(aten + "index_put.default").startswith("stub converter")
    assert registry.status(aten + "roll.default").startswith("stub converter")
    assert registry.status("torch.ops.dsv41.routed_experts.default") == "no converter"
    # converted by torchair's own AOT decomposition, not by a converter
    assert registry.status("torch.ops._c10d_functional.all_to_all_single.default") is None
    assert "torch.ops._c10d_functional.all_to_all_single.default" not in registry.converters


def test_unsupported_lists_what_torchair_cannot_lower(torchair_registry):
    tool, registry = torchair_registry
    ops = Counter({"torch.ops.aten.mm.default": 5, "torch.ops.aten.roll.default": 3})
    ((op, (count, why)),) = tool.unsupported(ops, registry).items()
    assert (op, count) == ("torch.ops.aten.roll.default", 3) and why.startswith("stub")


def test_tool_plans_rewrites_and_checks_a_graph(torchair_registry):
    tool, registry = torchair_registry
    models = {"tiny-swa": compile_config("tiny-swa", ONE_LAYER)}
    report = tool.check(models, registry, ["sp ep=1"])
    assert report == {"tiny-swa sp ep=1": {}}


def test_tool_checks_the_model_as_released(torchair_registry):
    """The released formats through torch_npu's MX ops: registered converters, and lowerable.
    At twice tiny-swa's width the entry gathers the q latent's FP8 rows and the bf16 kv latent
    side by side as bytes in one AllGather (`spmd.coalesce`: `view.dtype`, which torchair
    converts to GE's Bitcast)."""
    tool, registry = torchair_registry
    for op in ("npu_dynamic_mx_quant", "npu_anti_mx_quant", "npu_quant_matmul"):
        assert registry.status(f"torch.ops.npu.{op}.default") is None
    cfg = tool.model_config("tiny-swa", released=True).replace(
        n_layers=1, hc_sinkhorn_iters=3, dim=128
    )
    assert (cfg.weight_format, cfg.numerics) == ("released", "official")
    assert tool.check({"tiny-swa": cfg}, registry, ["sp ep=1"]) == {"tiny-swa sp ep=1": {}}
