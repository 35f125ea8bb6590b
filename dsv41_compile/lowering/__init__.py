"""lower: hand the per-rank ATen graph to a compiler, and run it with local parameter shards.

`eager` runs the FX graph as Python; `inductor` re-traces it with inductor's decompositions
(`compile_fx`), which schedules the functional collectives like any other op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import Shard
from torch.fx import GraphModule

from dsv41_compile.context import CompileContext
from dsv41_compile.validate import local_inputs

__all__ = ["ShardedProgram", "lower"]


class ShardedProgram:
    """The compiled per-rank graph as AOT calls it: full parameters in, local shards to the
    graph. Each sharded parameter is sliced once and reused until it is replaced or modified in
    place (its version counter moves)."""

    _boxed_call = True

    def __init__(
        self,
        compiled: Callable[..., Any],
        param_shards: dict[int, tuple[str, Shard]],
        tp: int,
        tp_rank: int,
    ) -> None:
        self.compiled = compiled
        self.param_shards = param_shards
        self.tp, self.tp_rank = tp, tp_rank
        self.tp_rank_tensor: torch.Tensor | None = None  # made at the first call, not under
        # the compile-time fake mode
        self._shards: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def local_shard(self, index: int, full: torch.Tensor) -> torch.Tensor:
        cached = self._shards.get(index)
        if cached is not None and cached[0] is full and cached[1] == full._version:
            return cached[2]
        _, placement = self.param_shards[index]
        shard = full.chunk(self.tp, placement.dim)[self.tp_rank].contiguous()
        self._shards[index] = (full, full._version, shard)
        return shard

    def __call__(self, args: list[Any]) -> Any:
        args = list(args)
        for index in self.param_shards:
            args[index] = self.local_shard(index, args[index])
        if self.tp_rank_tensor is None:
            self.tp_rank_tensor = torch.tensor(self.tp_rank, dtype=torch.int64)
        args.append(self.tp_rank_tensor)
        return self.compiled(*args)


def lower(gm: GraphModule, ctx: CompileContext) -> ShardedProgram:
    lowering = ctx.options.resolved_lowering(ctx.mesh.device_type)
    if lowering == "eager":
        compiled: Callable[..., Any] = gm.forward
    elif lowering == "inductor":
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, local_inputs(gm, ctx))
    else:
        raise AssertionError(f"unknown lowering {lowering!r} got past option checks")
    return ShardedProgram(compiled, dict(ctx.param_shards), ctx.mesh.tp, ctx.mesh.tp_rank)
