"""lower: hand the per-rank ATen graph to a compiler, and run it with local parameter shards.

`eager` runs the FX graph as Python; `inductor` re-traces it with inductor's decompositions
(`compile_fx`), which schedules the functional collectives like any other op; `torchair` hands
it to torchair's backend for graph-mode NPU execution (`lowering/torchair.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.fx import GraphModule

from dsv41_compile.collectives.expert_parallel import EP_TOKENS, EpLayer
from dsv41_compile.context import CompileContext, ParamShard
from dsv41_compile.validate import local_inputs

__all__ = ["ShardedProgram", "lower"]


class ShardedProgram:
    """The compiled per-rank graph as AOT calls it: full parameters in, local shards to the
    graph. Each sharded parameter is sliced once and reused until it is replaced or modified in
    place (its version counter moves). Appends the inputs the rewrite added: `tp_rank`, and for
    padded EP dispatch `ep_tokens` (the largest token-shard length over the EP group, agreed
    with one all-reduce(max) of an integer, outside the graph). The graph's trailing
    EP-statistics outputs (one per MoE layer, described by `ep_layers`) are kept in `ep_stats`,
    not returned; `on_ep_stats`, when set, receives them with the call's `ep_tokens` (or Tl)."""

    _boxed_call = True

    def __init__(
        self,
        compiled: Callable[..., Any],
        param_shards: dict[int, ParamShard],
        *,
        tp: int,
        tp_rank: int,
        token_index: int,
        device_type: str = "cpu",
        ep_layers: list[EpLayer] | None = None,
        ep_tokens_input: bool = False,
        on_ep_stats: Callable[[list[torch.Tensor], int], None] | None = None,
    ) -> None:
        self.compiled = compiled
        self.param_shards = param_shards
        self.tp, self.tp_rank, self.device_type = tp, tp_rank, device_type
        self.tp_rank_tensor: torch.Tensor | None = None  # made at the first call, not under
        # the compile-time fake mode
        self._shards: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self.token_index = token_index
        self.ep_layers = list(ep_layers or [])
        self.ep_tokens_input, self.on_ep_stats = ep_tokens_input, on_ep_stats
        self.ep_stats: list[torch.Tensor] = []
        self.ep_tokens = 0  # of the last call

    def local_shard(self, index: int, full: torch.Tensor) -> torch.Tensor:
        cached = self._shards.get(index)
        if cached is not None and cached[0] is full and cached[1] == full._version:
            return cached[2]
        shard = self.param_shards[index]
        local = full.chunk(shard.parts, shard.dim)[shard.index].contiguous()
        self._shards[index] = (full, full._version, local)
        return local

    def agree_ep_tokens(self, tokens: int) -> int:
        """The largest ceil(T/tp) over the EP group (the world)."""
        local = torch.tensor([-(-tokens // self.tp)], dtype=torch.int64, device=self.device_type)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return int(local.item())

    def __call__(self, args: list[Any]) -> Any:
        args = list(args)
        tokens = args[self.token_index].shape[0]
        for index in self.param_shards:
            args[index] = self.local_shard(index, args[index])
        if self.tp_rank_tensor is None:
            self.tp_rank_tensor = torch.tensor(self.tp_rank, dtype=torch.int64)
        args.append(self.tp_rank_tensor)
        ep_tokens = -(-tokens // self.tp)
        if self.ep_tokens_input:
            ep_tokens = self.agree_ep_tokens(tokens)
            args.append(ep_tokens)
        self.ep_tokens = ep_tokens
        outputs = self.compiled(*args)
        n_stats = len(self.ep_layers)
        if not n_stats:
            return outputs
        self.ep_stats = list(outputs[-n_stats:])
        if self.on_ep_stats is not None:
            self.on_ep_stats(self.ep_stats, ep_tokens)
        return type(outputs)(outputs[:-n_stats])


def lower(
    gm: GraphModule,
    ctx: CompileContext,
    on_ep_stats: Callable[[list[torch.Tensor], int], None] | None = None,
) -> ShardedProgram:
    lowering = ctx.options.resolved_lowering(ctx.mesh.device_type)
    if lowering == "eager":
        compiled: Callable[..., Any] = gm.forward
    elif lowering == "inductor":
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, local_inputs(gm, ctx))
    elif lowering == "torchair":
        from dsv41_compile.lowering.torchair import lower_torchair

        compiled = lower_torchair(gm, ctx)
    else:
        raise AssertionError(f"unknown lowering {lowering!r} got past option checks")
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return ShardedProgram(
        compiled,
        dict(ctx.param_shards),
        tp=ctx.mesh.tp,
        tp_rank=ctx.mesh.tp_rank,
        token_index=placeholders.index(ctx.token_input),
        device_type=ctx.mesh.device_type,
        ep_layers=ctx.ep_layers,
        ep_tokens_input=EP_TOKENS in placeholders,
        on_ep_stats=on_ep_stats,
    )
