"""The runtime wrapper hands the graph local parameter shards, sliced once, and strips the EP
statistics outputs."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from dsv41_compile.core.placements import ExpertShard
from dsv41_compile.core.signature import ParamInput, ParamShard, ProgramSignature
from dsv41_compile.moe.stats import EpLayer
from dsv41_compile.runtime.program import ProgramSpec, ShardedProgram


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
