"""Every user mistake the backend can see is an error that says what to change."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import dsv41_compile
from dsv41_compile.core.mesh import clear_mesh_cache
from dsv41_compile.model import DeepseekV41, ModelConfig
from dsv41_compile.testing.batches import Request, pack
from dsv41_compile.testing.torch_shims import fake_process_group

REQUESTS = [Request(0, [1, 2, 3], 0), Request(1, [4, 5], 0)]


@torch.library.custom_op("dsv41_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@mystery.register_fake
def _(x):
    return torch.empty_like(x)


def compile_and_run(
    options: dict, *, cfg=None, world: int | None = 8, patch=None, mark=True, fullgraph=True
):
    torch.manual_seed(0)
    model = DeepseekV41(cfg or ModelConfig.from_name("tiny-swa"))
    if patch is not None:
        patch(model)
    torch._dynamo.reset()
    clear_mesh_cache()
    ids, positions, slots = pack(REQUESTS)
    if mark:
        dsv41_compile.mark_token_dim(ids, positions, slots)
    compiled = torch.compile(
        model, backend="dsv41_sp", options={"lowering": "eager", **options}, fullgraph=fullgraph
    )
    if world is None:
        return compiled(ids, positions, slots, model.new_cache(4, 16))
    with fake_process_group(world_size=world, rank=1):
        try:
            return compiled(ids, positions, slots, model.new_cache(4, 16))
        finally:
            clear_mesh_cache()


def test_world_size_not_divisible_by_tp():
    with pytest.raises(
        Exception, match=r"tp=3 does not divide the world size 8.*choose tp in \[1, 2, 4, 8\]"
    ):
        compile_and_run({"tp": 3})


def test_tp_not_dividing_output_groups():
    cfg = ModelConfig.from_name("tiny-swa", o_groups=2)
    with pytest.raises(
        Exception,
        match=r"(?s)wo_a.weight.view.*not evenly divisible.*choose a tp that divides n_heads and o_groups",
    ):
        compile_and_run({"tp": 4}, cfg=cfg)


def test_tp_not_dividing_heads():
    cfg = ModelConfig.from_name("tiny-swa", n_heads=2, o_groups=2)
    with pytest.raises(Exception, match=r"attn_sink.*tp=8.*divides n_heads and o_groups"):
        compile_and_run({"tp": 8}, cfg=cfg)


def test_ep_must_be_the_world_or_one():
    with pytest.raises(Exception, match=r"ep=4: .* must be the world size 8 .* or 1"):
        compile_and_run({"tp": 4, "ep": 4})


def test_ep_not_dividing_the_routed_experts():
    cfg = ModelConfig.from_name("tiny-swa", n_routed_experts=12)
    with pytest.raises(Exception, match=r"ep=8 does not divide the 12 routed experts"):
        compile_and_run({"tp": 4, "ep": 8}, cfg=cfg)


def test_no_process_group():
    with pytest.raises(
        Exception, match="needs a process group: call torch.distributed.init_process_group"
    ):
        compile_and_run({"tp": 4}, world=None)


def test_graph_break_inside_the_model():
    def patch(model):
        ffn = model.layers[0].ffn
        forward = ffn.forward

        def broken(*args):
            torch._dynamo.graph_break()
            return forward(*args)

        ffn.forward = broken

    with pytest.raises(Exception, match="graph break.*fullgraph=True"):
        compile_and_run({"tp": 4}, patch=patch, fullgraph=False)


def test_op_without_a_rule_names_node_op_placements_and_source_line():
    def patch(model):
        ffn = model.layers[1].ffn
        forward = ffn.forward
        ffn.forward = lambda x, valid: forward(torch.ops.dsv41_test.mystery(x), valid)

    with pytest.raises(Exception) as info:
        compile_and_run({"tp": 4}, patch=patch)
    message = str(info.value)
    assert "node mystery" in message
    assert "dsv41_test.mystery.default" in message and "(S(0))" in message
    assert "test_errors.py" in message  # the model source line that called it


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"tp": 4, "pipeline": 2}, r"unknown dsv41_sp option\(s\) \['pipeline'\]"),
        ({"tp": 4, "ep": 0}, "ep must be a positive int, got 0"),
        ({"tp": 4, "ep": 8, "ep_dispatch": "capped"}, "ep_dispatch='capped' is not supported"),
        ({"tp": 4, "lowering": "xla"}, "lowering='xla' is not supported"),
        ({"tp": 4, "ep": 8, "lowering": "torchair"}, "lowering='torchair' needs ep_dispatch="),
        ({"tp": 4, "embedding": "tied"}, "embedding='tied' is not supported"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        dsv41_compile.BackendOptions.from_dict(options)
    with pytest.raises(Exception, match=match):
        compile_and_run(options)
