"""The runtime wrapper hands the graph local parameter shards, sliced once, and strips the EP
statistics outputs."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from dsv41_compile.core.placements import ExpertShard
from dsv41_compile.core.signature import ParamInput, ParamShard, ProgramSignature
from dsv41_compile.moe.stats import EpLayer
from dsv41_compile.runtime.program import PREPARATIONS, ProgramSpec, ShardedProgram


def test_parameters_are_sliced_once_and_resliced_after_an_update():
    seen = []

    def graph(weight, x, tp_rank):
        seen.append((weight, int(tp_rank)))
        return (x @ weight.t(),)

    shard = ParamShard("w", Shard(0), 0, 4, "tp")
    signature = ProgramSignature(
        params=(ParamInput(0, "w", (8, 4), torch.float32, shard=shard),),
        inputs=((1, "x"),),
        token_inputs=("x",),
    )
    spec = ProgramSpec(signature)
    program = ShardedProgram(graph, spec, tp=4, tp_rank=2, rank=6)
    weight = torch.arange(32.0).view(8, 4)
    x = torch.ones(3, 4)
    (out,) = program([weight, x])
    torch.testing.assert_close(out, x @ weight[4:6].t())  # rows [2*8/4, 3*8/4)
    program([weight, x])
    assert seen[0][0] is seen[1][0], "the shard is reused across calls"
    assert [r for _, r in seen] == [2, 2]

    with torch.no_grad():
        weight.mul_(2)  # an in-place update moves the version counter
    (out,) = program([weight, x])
    assert seen[2][0] is not seen[1][0]
    torch.testing.assert_close(out, x @ weight[4:6].t())


def test_expert_shards_by_world_rank_and_statistics_are_not_returned():
    def graph(experts, ids, tp_rank):
        return (experts.sum(0), torch.tensor([[1, 2], [3, 4]]))

    layer = EpLayer(
        layer=0, region="layers.0.ffn", dispatch="exact", ep=2, experts_per_rank=3, top_k=2,
        token_row_bytes=16,
    )  # fmt: skip
    seen = []
    shard = ParamShard("experts.w1", ExpertShard(0), 0, 2, "ep")
    signature = ProgramSignature(
        params=(ParamInput(0, "experts.w1", (6, 2), torch.float32, shard=shard),),
        inputs=((1, "ids"),),
        token_inputs=("ids",),
    )
    spec = ProgramSpec(signature, ep_layers=(layer,))
    program = ShardedProgram(
        graph, spec, tp=4, tp_rank=3, rank=1,
        on_ep_stats=lambda stats, tokens: seen.append((stats, tokens)),
    )  # fmt: skip
    experts = torch.arange(6.0)[:, None].expand(6, 2)
    outputs = program([experts, torch.zeros(5, dtype=torch.int64)])
    assert len(outputs) == 1
    torch.testing.assert_close(outputs[0], torch.tensor([12.0, 12.0]))  # experts 3, 4, 5
    ((stats,), tokens) = seen[0]
    assert stats.tolist() == [[1, 2], [3, 4]] and tokens == 2  # ceil(5 / 4)


def test_a_prepared_weight_is_made_once_from_its_shard_and_again_after_an_update():
    """A parameter the signature marks `prepare` (a layout a kernel reads, such as torch_npu's
    NZ for the grouped matmul's FP4 weights) reaches the graph as its preparation of the
    rank's shard -- or of the whole parameter, unsharded, or of the rank's own tensor read from
    a checkpoint -- made on the first call, kept while the weight is unchanged."""
    made = []

    def negated(t):
        made.append(t.shape)
        return -t

    def graph(sharded, whole, x, tp_rank):
        return (x @ sharded.t() + whole.sum(),)

    shard = ParamShard("w", Shard(0), 0, 4, "tp")
    signature = ProgramSignature(
        params=(
            ParamInput(0, "w", (8, 4), torch.float32, shard=shard, prepare="test_negated"),
            ParamInput(1, "b", (2,), torch.float32, prepare="test_negated"),
        ),
        inputs=((2, "x"),),
        token_inputs=("x",),
    )
    assert signature.prepared == {0: "test_negated", 1: "test_negated"}
    weight, bias, x = torch.arange(32.0).view(8, 4), torch.ones(2), torch.ones(3, 4)
    expected = x @ -weight[4:6].t() - 2
    with PREPARATIONS.restored():
        PREPARATIONS.add("test_negated", negated)
        program = ShardedProgram(graph, ProgramSpec(signature), tp=4, tp_rank=2, rank=6)
        for _ in range(2):
            (out,) = program([weight, bias, x])
            torch.testing.assert_close(out, expected)
        assert made == [(2, 4), (2,)]  # once each: the shard, the whole bias
        with torch.no_grad():
            bias.mul_(3)
        program([weight, bias, x])
        assert made == [(2, 4), (2,), (2,)]
        read = {0: weight[4:6].clone(), 1: bias}  # a checkpoint's: the rank's own already
        loaded = ShardedProgram(
            graph, ProgramSpec(signature), tp=4, tp_rank=2, rank=6, weights=read
        )
        (out,) = loaded([weight, bias, x])
        torch.testing.assert_close(out, x @ -weight[4:6].t() - 6)
    with pytest.raises(ValueError, match="prepared by 'test_negated', which no target"):
        ShardedProgram(graph, ProgramSpec(signature), tp=4, tp_rank=2, rank=6)([weight, bias, x])
