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

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dsv41_compile.core.torch_private import FakeTensorMode
from dsv41_compile.deepseek_v41.testing.presets import ONE_LAYER, compile_config
from dsv41_compile.targets.npugraph_ex import npu_kernel_gaps
from dsv41_compile.testing.torchair_standin import register_npu_ops


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


def test_npu_kernels_are_read_from_torch_npus_registration(torchair_registry):
    """`--lowering npugraph_ex`: torch_npu's own NPU kernels (its registration file in the
    wheel); an op without one runs where the ops of its composite kernel run
    (`targets.npugraph_ex.npu_kernel_gaps`): `frexp` does not (torch_npu has no `frexp.out`),
    `ldexp` does (a pow and a mul); a custom op of ours has no kernel."""
    tool, _ = torchair_registry
    kernels = tool.scan_kernels(tool.CACHE / tool.KERNELS)
    aten = torch.ops.aten
    for op in (aten.mm.default, aten.index_put.default, aten.scatter_reduce.two, aten.pow.Scalar):
        assert kernels.has_kernel(op), op
    register_npu_ops()  # what importing torch_npu does
    assert kernels.has_kernel(torch.ops.npu.npu_grouped_matmul.default)
    assert not kernels.has_kernel(aten.frexp.Tensor)
    assert not kernels.has_kernel(aten.ldexp.Tensor)

    def edited(x, e):
        mantissa, exponent = torch.frexp(x)
        return torch.ldexp(mantissa, e), exponent

    with FakeTensorMode():
        gm = make_fx(edited)(torch.randn(4), torch.ones(4, dtype=torch.int32))
    assert npu_kernel_gaps(gm, kernels.has_kernel) == {
        "aten.frexp.Tensor -> aten.frexp.Tensor_out": ["frexp"]
    }
    models = {"tiny-swa": compile_config("tiny-swa", ONE_LAYER)}
    assert tool.check(models, kernels, ["sp ep=1"]) == {"tiny-swa sp ep=1": {}}
