"""The torchair lowering on CPU: what it hands to torchair, with torchair replaced by
`testing.torchair_standin` (records what its one entry point, `get_npu_backend`, is handed, runs
torchair's AOT step on it, then runs it eagerly). Nothing here runs torchair or an NPU."""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest
import torch

from dsv41_compile.core.collectives import collective_kind
from dsv41_compile.core.hooks import Hooks, installed
from dsv41_compile.deepseek_v41.graph_mode import grouped_matmul
from dsv41_compile.deepseek_v41.testing.fake_rank import compile_on_fake_rank
from dsv41_compile.deepseek_v41.testing.presets import ONE_LAYER, compile_config
from dsv41_compile.moe.stats import ep_layers
from dsv41_compile.testing.observe import capture_programs
from dsv41_compile.testing.torchair_standin import TorchairStandIn, graph_ops


@pytest.fixture(scope="module")
def handed(tmp_path_factory):
    standin = TorchairStandIn()
    dump = tmp_path_factory.mktemp("dump")
    options = {"tp": 4, "ep": 8, "ep_dispatch": "padded", "lowering": "torchair"}
    with installed(Hooks(torchair=standin)), capture_programs() as programs:
        gm, ctx, logits = compile_on_fake_rank(3, {**options, "dump_dir": str(dump)})
    (rewritten, _), *_ = programs
    return standin.handed, rewritten, ctx, logits, dump, standin.aot_graphs


def test_torchair_gets_the_rewritten_per_rank_graph_with_local_shapes(handed):
    calls, rewritten, ctx, logits, *_ = handed
    ((gm, inputs, _config),) = calls
    assert gm is rewritten
    assert logits.shape == (8, 512)
    cfg = compile_config()
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    by_fqn = {
        ctx.param_fqns[n]: inputs[i] for i, n in enumerate(placeholders) if n in ctx.param_fqns
    }
    H, d, E = cfg.n_heads, cfg.head_dim, cfg.n_routed_experts
    assert by_fqn["layers.0.attn.wq_b.weight"].shape == (H * d // 4, cfg.q_lora_rank)
    assert by_fqn["layers.0.ffn.experts.w1"].shape == (E // 8, cfg.moe_inter_dim, cfg.dim)
    # weights go in as parameters (what torchair freezes); activations do not
    assert all(isinstance(t, torch.nn.Parameter) for t in by_fqn.values())
    assert not isinstance(inputs[placeholders.index(ctx.token_input)], torch.nn.Parameter)
    assert "tp_rank" in placeholders and "ep_tokens" in placeholders


def test_torchair_graph_has_the_layout_collectives_and_no_host_read(handed):
    calls, *_, aot_graphs = handed
    ((gm, _, _),) = calls
    (aot,) = aot_graphs  # after torchair's AOT step: what its converters see
    for graph in (gm, aot):
        kinds = Counter(collective_kind(n) for n in graph.graph.nodes if collective_kind(n))
        # per layer: the attention input gathered, wo_b's partial reduce-scattered (the
        # default attn_exit at 8 rows per step), the EP rows with their routes, the combine;
        # + the exit gather
        assert kinds == {"all_gather": 3, "reduce_scatter": 2, "all_to_all": 4}
        targets = {n.target for n in graph.graph.nodes}
        assert torch.ops.aten._local_scalar_dense.default not in targets


def test_torchair_graph_is_rewritten_for_graph_mode(handed):
    """No op graph_mode replaces reaches torchair (tools/torchair_coverage.py checks the rest
    against torchair's converters), and the routed experts go through torch_npu's grouped
    matmul."""
    calls, _, ctx, *_ = handed
    ((gm, _, _),) = calls
    aten = torch.ops.aten
    replaced = {
        aten.softplus.default, aten.index_put.default, aten.scatter_reduce.two,
        aten.where.ScalarOther, aten.roll.default, aten.amax.default, aten.unflatten.int,
        aten._assert_scalar.default, torch.ops.dsv41.routed_experts.default,
    }  # fmt: skip
    targets = Counter(n.target for n in gm.graph.nodes)
    assert not replaced & set(targets)
    assert targets[aten.scatter.src] >= 2  # the padded dispatch buffers
    # each MoE layer: w1, w3, w2 through torch_npu's grouped matmul, one group per local expert
    grouped = gm.graph.find_nodes(op="call_function", target=grouped_matmul())
    assert len(grouped) == 3 * len(ep_layers(ctx)) > 0


def test_config_carries_our_options(handed):
    calls, _, ctx, _, dump, _ = handed
    ((_, _, config),) = calls
    assert config.mode == "max-autotune"
    assert config.experimental_config.frozen_parameter is True
    assert config.debug.graph_dump.type == "py"
    assert config.debug.graph_dump.path == str(dump / f"rank{ctx.mesh.rank}" / "torchair")


@pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed"
)
@pytest.mark.parametrize("lowering", ["torchair", "npugraph_ex"])
def test_without_torch_npu_an_npu_lowering_is_an_error_that_says_what_to_install(lowering):
    # the error is the lowering's, not the model's: one layer is enough
    one_layer = compile_config("tiny-swa", ONE_LAYER)
    needs = rf"lowering='{lowering}' needs torch_npu .*pip install 'dsv41-compile\[npu\]'"
    with pytest.raises(Exception, match=needs):
        compile_on_fake_rank(1, {"tp": 4, "lowering": lowering}, cfg=one_layer)


def test_every_op_torchair_would_see_has_a_converter(handed, torchair_registry):
    *_, aot_graphs = handed
    tool, registry = torchair_registry
    (aot,) = aot_graphs
    assert tool.unsupported(graph_ops(aot), registry) == {}
