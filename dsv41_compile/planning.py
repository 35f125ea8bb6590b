"""Plan a model for a world of ranks without the ranks, the weights or a device.

`plan_rank(config, options, world_size=8, rank=r)` builds the model of `config` on the meta
device (no weight is allocated; the family's `ModelAdapter.planning_example`), compiles it with
`dsv41_sp` on a `fake` process group of `world_size` ranks in this process and stops after the
pipeline (`plan_model`, for a model and a call of one's own, such as an edited model:
`testing.snapshot`): the result is rank r's rewritten, verified graph and its compile context -- the
plan, the collectives and their local shapes at the model's real sizes (`"flash"` included),
for `tools/explain.py`, the accounting (`report.accounting`) and `tools/comm_report.py`.
Nothing runs: a fake group's collectives move no data. `progress="..."` shows a bar on
standard error while the pipeline's passes run (flash's planning takes a minute or more; none
where standard error is not a terminal).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import GraphModule
from tqdm import tqdm

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.fake_world import fake_world
from dsv41_compile.core.hooks import Hooks, PipelineStopped, installed
from dsv41_compile.families import adapters
from dsv41_compile.frontend.tokens import mark_token_dim

__all__ = ["plan_model", "plan_rank"]


def plan_rank(
    config: Any,
    options: dict[str, Any],
    *,
    world_size: int,
    rank: int = 0,
    progress: str | None = None,
    **example: Any,
) -> tuple[GraphModule, CompileContext, torch.nn.Module]:
    """Rank `rank`'s rewritten graph of the meta-device model of `config` compiled with
    `options` in a fake world of `world_size` ranks, its compile context, and the (meta) model.
    The token count is symbolic: `example` only shapes the example call Dynamo traces (DeepSeek
    V4.1: `requests`, a batch; `max_len`, the cache's positions per request, static: it sizes
    the attention over the cache)."""
    model, args, token_inputs = _example(config, example)
    gm, ctx = plan_model(model, args, options, world_size=world_size, rank=rank,
                         token_inputs=token_inputs, progress=progress)  # fmt: skip
    return gm, ctx, model


def plan_model(
    model: torch.nn.Module,
    args: Sequence[Any],
    options: dict[str, Any],
    *,
    world_size: int,
    rank: int = 0,
    token_inputs: Sequence[torch.Tensor] = (),
    kwargs: dict[str, Any] | None = None,
    progress: str | None = None,
) -> tuple[GraphModule, CompileContext]:
    """Rank `rank`'s rewritten, verified graph of `model` called on `args` (and `kwargs`),
    compiled with `options` in a fake world of `world_size` ranks, and its compile context. The
    model may be on the meta device (nothing runs either way: the compile stops after the
    pipeline); `token_inputs` are marked with `mark_token_dim`. `progress`: the label of a bar
    counting the passes on standard error (shown only on a terminal)."""
    planned: list[tuple[GraphModule, CompileContext]] = []
    hidden = None if progress is not None else True  # tqdm's None: shown on a terminal only
    bar = tqdm(desc=progress, file=sys.stderr, disable=hidden,
               bar_format="{desc}: {n} passes, {elapsed}{postfix}")  # fmt: skip
    bar.set_postfix_str("tracing")

    def keep(name: str, gm: GraphModule, ctx: CompileContext) -> None:
        bar.set_postfix_str(f"{name} done", refresh=False)
        bar.update()
        if name == "verify":
            planned.append((gm, ctx))

    hooks = Hooks(after_pass=keep, stop_after="verify")
    torch.compiler.reset()
    mark_token_dim(*token_inputs)  # after the reset, which forgets what marking installs
    try:
        with fake_world(world_size=world_size, rank=rank), installed(hooks):
            compiled = torch.compile(model, backend="dsv41_sp", options=options, fullgraph=True)
            try:
                compiled(*args, **(kwargs or {}))
            except Exception as error:  # Dynamo wraps the stop
                if not planned or not _stopped(error):
                    raise
    finally:
        bar.close()
        torch.compiler.reset()
    (gm, ctx), *_ = planned
    return gm, ctx


def _example(config: Any, example: dict[str, Any]) -> tuple[torch.nn.Module, tuple, tuple]:
    """The meta model, example arguments and token inputs of the family `config` belongs to."""
    for adapter in adapters():
        found = adapter.planning_example(config, **example)
        if found is not None:
            return found
    raise ValueError(
        f"plan_rank: no registered model family builds a model from a {type(config).__name__}; "
        "pass a config of a known family (dsv41_compile.deepseek_v41.model.ModelConfig) or register an "
        "adapter whose planning_example accepts it (docs/architecture.md)"
    )


def _stopped(error: BaseException | None) -> bool:
    while error is not None:
        if isinstance(error, PipelineStopped):
            return True
        error = error.__cause__ or error.__context__
    return False
