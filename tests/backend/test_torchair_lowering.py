"""The torchair lowering on CPU: what it hands to torchair, with torchair's one entry point
(`get_npu_backend`) replaced by a recorder. Nothing here runs torchair or an NPU."""

from __future__ import annotations

import importlib.util
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from test_backend_graph import compile_on_fake_rank

from dsv41_compile.lowering import torchair as torchair_lowering
from dsv41_compile.model import ModelConfig
from dsv41_compile.testing.capture import capture_programs
from dsv41_compile.validate import collective_kind


class Strict(SimpleNamespace):
    """Like torchair's config sections: setting an attribute it does not have is an error."""

    def __setattr__(self, name, value):
        if name not in self.__dict__:
            raise AttributeError(f"torchair's CompilerConfig has no {name!r}")
        super().__setattr__(name, value)


class FakeTorchair:
    """The attribute paths of torch-npu 2.13.0's CompilerConfig (configs/compiler_config.py,
    experimental_config.py, debug_config.py), and a get_npu_backend that records its input."""

    def __init__(self):
        self.handed = []

    @staticmethod
    def CompilerConfig():
        return Strict(
            mode="reduce-overhead",  # not torchair's default: the lowering must set it
            experimental_config=Strict(frozen_parameter=False),
            debug=Strict(graph_dump=Strict(type=None, path=None)),
        )

    def get_npu_backend(self, *, compiler_config):
        def backend(gm, example_inputs):
            self.handed.append((gm, example_inputs, compiler_config))
            return gm.forward

        return backend


@pytest.fixture(scope="module")
def handed(tmp_path_factory):
    fake = FakeTorchair()
    patch = pytest.MonkeyPatch()
    patch.setattr(torchair_lowering, "import_torchair", lambda: fake)
    dump = tmp_path_factory.mktemp("dump")
    options = {"tp": 4, "ep": 8, "ep_dispatch": "padded", "lowering": "torchair"}
    try:
        with capture_programs() as programs:
            gm, ctx, logits = compile_on_fake_rank(3, {**options, "dump_dir": str(dump)})
    finally:
        patch.undo()
    (rewritten, _), *_ = programs
    return fake.handed, rewritten, ctx, logits, dump


def test_torchair_gets_the_rewritten_per_rank_graph_with_local_shapes(handed):
    calls, rewritten, ctx, logits, _ = handed
    ((gm, inputs, _config),) = calls
    assert gm is rewritten
    assert logits.shape == (8, 512)
    cfg = ModelConfig.from_name("tiny-swa")
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
    calls, *_ = handed
    ((gm, _, _),) = calls
    kinds = Counter(collective_kind(n) for n in gm.graph.nodes if collective_kind(n))
    assert kinds == {"all_gather": 3, "reduce_scatter": 2, "all_to_all": 6}  # + exit gather
    assert not any(n.target is torch.ops.aten._local_scalar_dense.default for n in gm.graph.nodes)


def test_config_carries_our_options(handed):
    calls, _, ctx, _, dump = handed
    ((_, _, config),) = calls
    assert config.mode == "max-autotune"
    assert config.experimental_config.frozen_parameter is True
    assert config.debug.graph_dump.type == "py"
    assert config.debug.graph_dump.path == str(dump / f"rank{ctx.mesh.rank}" / "torchair")


@pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed"
)
def test_without_torch_npu_torchair_is_an_error_that_says_what_to_install():
    with pytest.raises(Exception, match=r"pip install 'dsv41-compile\[npu\]'"):
        compile_on_fake_rank(1, {"tp": 4, "lowering": "torchair"})
