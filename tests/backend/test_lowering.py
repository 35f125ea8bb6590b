"""The runtime wrapper hands the graph local parameter shards, sliced once."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from dsv41_compile.lowering import ShardedProgram


def test_parameters_are_sliced_once_and_resliced_after_an_update():
    seen = []

    def graph(weight, x, tp_rank):
        seen.append((weight, int(tp_rank)))
        return (x @ weight.t(),)

    program = ShardedProgram(graph, {0: ("w", Shard(0))}, tp=4, tp_rank=2)
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
