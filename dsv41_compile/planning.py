"""Plan a model for a world of ranks without the ranks, the weights or a device.

`plan_rank(cfg, options, world_size=8, rank=r)` builds the model on the meta device (no weight
is allocated), compiles it with `dsv41_sp` on a `fake` process group of `world_size` ranks in
this process and stops after the pipeline: the result is rank r's rewritten, verified graph
and its compile context -- the plan, the collectives and their local shapes at the model's real
sizes (`"flash"` included), for `tools/explain.py`, the accounting (`report.accounting`) and
`tools/comm_report.py`. Nothing runs: a fake group's collectives move no data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch._dynamo
from torch.fx import GraphModule

import dsv41_compile
from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.fake_world import fake_world
from dsv41_compile.core.hooks import Hooks, PipelineStopped, installed
from dsv41_compile.core.mesh import clear_mesh_cache
from dsv41_compile.model.batches import Request, pack
from dsv41_compile.model.config import ModelConfig
from dsv41_compile.model.model import DeepseekV41

__all__ = ["plan_rank"]

_DEFAULT_REQUESTS = (Request(0, [1, 2, 3], 0), Request(1, [4, 5], 0))


def plan_rank(
    cfg: ModelConfig,
    options: dict[str, Any],
    *,
    world_size: int,
    rank: int = 0,
    requests: Sequence[Request] = _DEFAULT_REQUESTS,
    max_len: int = 64,
) -> tuple[GraphModule, CompileContext, DeepseekV41]:
    """Rank `rank`'s rewritten graph of a meta-device model `cfg` compiled with `options` in a
    fake world of `world_size` ranks, its compile context, and the (meta) model. The token count
    is symbolic: `requests` only give Dynamo an example batch; the cache holds `max_len`
    positions per request (static: it sizes the attention over the cache)."""
    with torch.device("meta"):
        model = DeepseekV41(cfg)
        cache = model.new_cache(num_slots=len(requests), max_len=max_len)
    ids, positions, slots = (t.to("meta") for t in pack(list(requests)))
    dsv41_compile.mark_token_dim(ids, positions, slots)
    planned: list[tuple[GraphModule, CompileContext]] = []

    def keep(name: str, gm: GraphModule, ctx: CompileContext) -> None:
        if name == "verify":
            planned.append((gm, ctx))

    hooks = Hooks(after_pass=keep, stop_after="verify")
    torch._dynamo.reset()
    clear_mesh_cache()
    try:
        with fake_world(world_size=world_size, rank=rank), installed(hooks):
            compiled = torch.compile(model, backend="dsv41_sp", options=options, fullgraph=True)
            try:
                compiled(ids, positions, slots, cache)
            except Exception as error:  # Dynamo wraps the stop
                if not planned or not _stopped(error):
                    raise
    finally:
        clear_mesh_cache()
        torch._dynamo.reset()
    (gm, ctx), *_ = planned
    return gm, ctx, model


def _stopped(error: BaseException) -> bool:
    while error is not None:
        if isinstance(error, PipelineStopped):
            return True
        error = error.__cause__ or error.__context__
    return False
