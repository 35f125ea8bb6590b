"""The DTensor adapter: DTensor's rules answer the single-axis questions the passes will ask
(tests/core/test_torch_private.py checks the private names it uses)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

import dsv41_compile.deepseek_v41.model.ops  # noqa: F401  (registers dsv41::routed_experts)
from dsv41_compile.core.placements import format_placement
from dsv41_compile.spmd.rules import dtensor as dtensor_adapter
from dsv41_compile.spmd.rules.dtensor import PlacedTensor, propagate
from dsv41_compile.testing.torch_shims import fake_process_group

aten = torch.ops.aten
f32 = torch.float32


@pytest.fixture(scope="module")
def mesh():
    with fake_process_group(world_size=4):
        yield DeviceMesh("cpu", torch.arange(4), mesh_dim_names=("tp",))


def placed(shape: tuple[int, ...], placement, dtype: torch.dtype = f32) -> PlacedTensor:
    return PlacedTensor(shape, dtype, placement)


def test_token_sharded_matmul_stays_token_sharded(mesh) -> None:
    strategy = propagate(
        aten.mm.default, [placed((8, 16), Shard(0)), placed((16, 4), Replicate())], mesh
    )
    assert str(strategy) == "(S(0), R) -> S(0)"


def test_row_parallel_matmul_is_a_partial_sum(mesh) -> None:
    strategy = propagate(
        aten.mm.default, [placed((8, 16), Shard(1)), placed((16, 4), Shard(0))], mesh
    )
    assert str(strategy) == "(S(1), S(0)) -> P"
    assert strategy.outputs == (Partial(),)


def test_head_sharded_batched_matmul(mesh) -> None:
    # [T, H, d] @ [T, d, S] with heads sharded and the KV latent replicated: heads stay sharded.
    strategy = propagate(
        aten.bmm.default, [placed((8, 4, 16), Shard(1)), placed((8, 16, 5), Replicate())], mesh
    )
    assert str(strategy) == "(S(1), R) -> S(1)"


def test_incompatible_inputs_ask_for_a_redistribution(mesh) -> None:
    # Adding a token-sharded and a replicated tensor elementwise: one side must change.
    strategy = propagate(
        aten.add.Tensor, [placed((8, 16), Shard(0)), placed((8, 16), Shard(1))], mesh
    )
    assert strategy.inputs[0] == strategy.inputs[1]
    assert strategy.outputs == (strategy.inputs[0],)


def test_op_without_a_rule(mesh) -> None:
    with pytest.raises(NotImplementedError, match="no sharding rule for dsv41.routed_experts"):
        propagate(torch.ops.dsv41.routed_experts.default, [placed((8, 16), Shard(0))], mesh)


def test_each_distinct_question_goes_to_dtensor_once(mesh, monkeypatch) -> None:
    """A repeated layer asks the same questions: the answer, or the refusal, is kept. A list
    argument and a tuple one are different questions."""
    asked = []
    ask = dtensor_adapter._propagate

    def counted(op, args, *rest):
        asked.append(op)
        return ask(op, args, *rest)

    monkeypatch.setattr(dtensor_adapter, "_propagate", counted)
    answers: dict = {}  # one compile's memo
    args = [placed((8, 16), Shard(0)), placed((16, 4), Replicate())]
    first = propagate(aten.mm.default, args, mesh, answers=answers)
    assert propagate(aten.mm.default, list(args), mesh, answers=answers) is first
    row_parallel = [placed((8, 16), Shard(1)), placed((16, 4), Shard(0))]
    assert propagate(aten.mm.default, row_parallel, mesh, answers=answers).outputs == (Partial(),)
    experts = torch.ops.dsv41.routed_experts.default
    for _ in range(2):
        with pytest.raises(NotImplementedError, match="no sharding rule for dsv41.routed_experts"):
            propagate(experts, [placed((8, 16), Shard(0))], mesh, answers=answers)
    assert asked == [aten.mm.default, aten.mm.default, experts]
    propagate(aten.mm.default, args, mesh)  # no memo: asked again
    assert asked[-1] is aten.mm.default and len(asked) == 4
    key = dtensor_adapter._hashable
    assert key([1, (2, 3)]) == ("list", 1, ("tuple", 2, 3)) != key((1, (2, 3)))


def test_format_placement() -> None:
    assert [
        format_placement(p) for p in (Shard(1), Replicate(), Partial(), Partial("max"), None)
    ] == [
        "S(1)",
        "R",
        "P",
        "P(max)",
        "-",
    ]
