"""The npugraph_ex lowering on CPU: what it hands to torch_npu's npugraph_ex, with npugraph_ex
replaced by `testing.npugraph_ex_standin` (records what `get_npu_backend` is handed and how each
call would run, runs npugraph_ex's AOT step, then the graph eagerly); and the capture check
(`targets.capture_check`) on graphs a capture cannot replay. Nothing here runs torch_npu or an NPU;
8 gloo ranks through the stand-in, with each call captured, replayed or (past `capture_tokens`)
uncaptured: tests/distributed/test_numerics.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dsv41_compile.core.hooks import Hooks, installed
from dsv41_compile.core.torch_private import FakeTensorMode
from dsv41_compile.deepseek_v41.graph_mode import grouped_matmul
from dsv41_compile.deepseek_v41.testing.fake_rank import compile_on_fake_rank
from dsv41_compile.deepseek_v41.testing.presets import AS_RELEASED, ONE_LAYER, compile_config
from dsv41_compile.options import BackendOptions
from dsv41_compile.planning import plan_rank
from dsv41_compile.targets.capture_check import capture_problems
from dsv41_compile.targets.npu_passes import npu_ops
from dsv41_compile.targets.npugraph_ex import check_npu_kernels, npu_kernel_gaps, torch_npu_in_use
from dsv41_compile.testing.npugraph_ex_standin import NpugraphExStandIn
from dsv41_compile.testing.observe import capture_programs
from dsv41_compile.testing.torchair_standin import register_npu_ops

aten = torch.ops.aten
OPTIONS = {"tp": 4, "ep": 8, "ep_dispatch": "padded", "lowering": "npugraph_ex"}
RELEASED = compile_config("tiny-swa", (*ONE_LAYER, *AS_RELEASED))
"""One window-only layer as released: FP8 / FP4 weights, the official numerics."""


@pytest.fixture(scope="module")
def handed():
    standin = NpugraphExStandIn()
    with installed(Hooks(npugraph_ex=standin)), capture_programs() as programs:
        gm, ctx, logits = compile_on_fake_rank(3, OPTIONS, cfg=RELEASED)
    (rewritten, _), *_ = programs
    return standin, rewritten, ctx, logits


def test_npugraph_ex_gets_the_per_rank_graph_twice_captured_and_not(handed):
    standin, rewritten, ctx, logits = handed
    (gm, inputs, captured), (gm2, inputs2, uncaptured) = standin.handed
    assert gm is gm2 is rewritten and inputs is inputs2
    assert logits.shape == (8, 512)
    # weights as parameters (static inputs of a capture), activations not
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    params = [i for i, n in enumerate(placeholders) if n in ctx.param_fqns]
    assert params and all(isinstance(inputs[i], torch.nn.Parameter) for i in params)
    assert not isinstance(inputs[placeholders.index(ctx.token_input)], torch.nn.Parameter)
    for config in (captured, uncaptured):
        assert config.frozen_parameter is True and config.clone_output is True
        assert config.capture_limit == BackendOptions().capture_tokens + 1
        assert config.static_kernel_compile is False
    assert (captured.force_eager, uncaptured.force_eager) == (False, True)
    assert standin.calls == [("capture", 8)]  # the one call, 8 tokens


def test_the_model_rewrites_reach_npugraph_ex_and_the_aten_ones_do_not(handed):
    """The routed experts go through torch_npu's grouped matmul and the released formats through
    its MX ops (the model's rewrites); of graph_mode's ATen rewrites only those of the ops
    torch_npu has no kernel for (`frexp`, `copysign`); the others' ops stay (the cache writes'
    `index_put`: torchair's get scatters); no host read (padded EP)."""
    standin, gm, ctx, _ = handed
    targets = {n.target for n in gm.graph.nodes}
    assert not {t for t in targets if str(t).startswith("dsv41.")}
    assert gm.graph.find_nodes(op="call_function", target=grouped_matmul())
    assert torch.ops.npu.npu_dynamic_mx_quant.default in targets
    assert not {aten.frexp.Tensor, aten.copysign.Tensor, aten._assert_async.msg} & targets
    assert aten.index_put.default in targets
    assert aten._local_scalar_dense.default not in targets
    (aot,) = standin.aot_graphs  # one per graph, though handed over twice
    assert aten._local_scalar_dense.default not in {n.target for n in aot.graph.nodes}


def test_every_op_npugraph_ex_would_run_has_an_npu_kernel(handed, torchair_registry):
    """After npugraph_ex's AOT step: every op has a kernel in torch_npu 2.13.0's registration,
    or is a view or a composite whose ops have one (`npu_kernel_gaps`)."""
    standin, *_ = handed
    tool, _ = torchair_registry
    kernels = tool.scan_kernels(tool.CACHE / tool.KERNELS)
    (aot,) = standin.aot_graphs
    assert npu_kernel_gaps(aot, kernels.has_kernel) == {}


def test_the_capture_check_refuses_the_exact_ep_lowerings_host_reads():
    """The exact EP lowering sizes its all-to-alls by counts read on the host: each read is
    named, with the option that avoids it. `BackendOptions` refuses the combination first."""
    gm, ctx, _ = plan_rank(
        compile_config("tiny-swa", ONE_LAYER),
        {"tp": 4, "ep": 8, "ep_dispatch": "exact", "lowering": "eager"},
        world_size=8,
    )
    gm = copy.deepcopy(gm)
    register_npu_ops()  # what importing torch_npu does
    npu_ops(gm, ctx=ctx)  # the npugraph_ex target's first pass: every node's local value
    problems = capture_problems(gm, torch.device("meta"))  # planned on meta tensors
    assert problems and {p.kind for p in problems} == {"host read"}
    assert len(problems) == 2 * 8  # per peer: the rows sent, the rows received
    text = str(problems[0])
    assert "node ep_send_0 (aten._local_scalar_dense.default)" in text
    assert "use ep_dispatch='padded' (the exact EP lowering reads each peer's row count" in text
    with pytest.raises(ValueError, match="lowering='npugraph_ex' needs ep_dispatch='padded'"):
        BackendOptions(**{**OPTIONS, "ep_dispatch": "exact"})


def test_the_capture_check_names_a_host_read_a_data_dependent_size_and_another_device():
    def edited(x):
        n = x.sum().item()  # a host read
        rows = torch.nonzero(x > 0)  # a size set by the values
        bias = torch.ones(3, device="meta")  # another device
        return x * n, rows, bias

    gm = make_fx(edited, tracing_mode="symbolic")(torch.randn(5, 3))
    problems = capture_problems(gm, torch.device("cpu"))
    by_kind = {p.kind: str(p) for p in problems}
    assert sorted(by_kind) == ["data-dependent size", "device", "host read"]
    assert "(aten._local_scalar_dense.default)" in by_kind["host read"]
    assert "use keep the value on the device: select with torch.where" in by_kind["host read"]
    assert "(aten.nonzero.default)" in by_kind["data-dependent size"]
    assert "a tensor on meta, not cpu" in by_kind["device"]
    # a value made from the read is not reported again: one problem per kind
    assert len(problems) == 3


def test_auto_chooses_npugraph_ex_for_npu_tensors_and_torchair_stays_by_name():
    assert BackendOptions().target("npu") == "npugraph_ex"
    assert BackendOptions(lowering="torchair").target("npu") == "torchair"
    with pytest.raises(ValueError, match="lowering='auto' chose npugraph_ex"):
        BackendOptions(ep=8, ep_dispatch="exact").target("npu")
    with pytest.raises(ValueError, match="capture_tokens must be an int >= 0"):
        BackendOptions(capture_tokens=-1)


def test_the_kernel_check_names_each_op_without_an_npu_kernel():
    """`check_npu_kernels` (run by the capture check where torch_npu is in use) against the
    dispatcher: here, without torch_npu, no op has a PrivateUse1 kernel, so every op that is
    not a view is named, a composite (`frexp`; `mul`'s functional form, written over its
    `out=` form) through the ops its kernel calls, each node once; a view passes."""
    assert not torch_npu_in_use()

    def edited(x):
        mantissa, _ = torch.frexp(x)
        return (mantissa * 2).view(-1)

    with FakeTensorMode():
        gm = make_fx(edited)(torch.randn(2, 3))
    with pytest.raises(ValueError) as info:
        check_npu_kernels(gm)
    assert str(info.value) == (
        "lowering='npugraph_ex': torch_npu has no NPU kernel for aten.frexp.Tensor -> "
        "aten.empty_like.default -> aten.empty_strided.default (frexp); aten.frexp.Tensor -> "
        "aten.frexp.Tensor_out (frexp); aten.mul.Tensor -> aten.empty.memory_format (mul); "
        "aten.mul.Tensor -> aten.mul.out (mul). Change the model so it does not call them, or "
        "use lowering='eager' to run elsewhere; tools/torchair_coverage.py --lowering "
        "npugraph_ex lists them for any preset"
    )
