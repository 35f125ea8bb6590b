"""DeepSeek V4.1 on one rank of a fake world (`testing.fake_rank`).

`compile_on_fake_rank(rank, options)` compiles a model (tiny-swa with 3 Sinkhorn iterations
by default: `deepseek_v41.testing.presets.compile_config`) with `dsv41_sp` as rank `rank` of a
`fake` process group of 8 ranks (collectives move no data) and runs it once: it returns that
rank's rewritten graph, its compile context and the logits (which mean nothing: no data moved).
Results are kept for the process, keyed by the arguments: a test session compiles each
configuration once. `run_on_fake_rank` only calls the model: nothing watches the pipeline, so
the host's compile cache (`runtime.host_cache`) serves every rank of a graph compiled before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import GraphModule

from dsv41_compile.core.context import CompileContext
from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig
from dsv41_compile.deepseek_v41.testing.batches import Request, pack
from dsv41_compile.deepseek_v41.testing.presets import compile_config
from dsv41_compile.testing.fake_rank import compile_model_on_fake_rank, compiled_call

__all__ = ["REQUESTS", "compile_on_fake_rank", "run_on_fake_rank"]

REQUESTS = (Request(0, (1, 2, 3), 0), Request(1, (4, 5), 0), Request(2, (6, 7, 8), 0))
"""The seed's example batch of one DP group: requests of 3, 2 and 3 tokens."""

_COMPILED: dict[tuple, tuple[GraphModule, CompileContext, torch.Tensor]] = {}


def compile_on_fake_rank(
    rank: int,
    options: dict[str, Any],
    cfg: ModelConfig | None = None,
    requests: Sequence[Request] = REQUESTS,
    *,
    mark: bool = True,
    world_size: int = 8,
) -> tuple[GraphModule, CompileContext, torch.Tensor]:
    """Rank `rank`'s rewritten graph of `cfg` (`compile_config()`) under `options` (eager
    lowering unless given), its context and its logits on `requests`; `mark`: the token count
    is marked (`mark_token_dim`), else Dynamo traces it as it does a first call."""
    cfg = cfg or compile_config()
    requests = tuple(Request(r.slot, tuple(r.ids), r.start) for r in requests)
    key = (rank, tuple(sorted(options.items())), cfg, requests, mark, world_size)
    if key not in _COMPILED:
        model, args, marked = _model_and_inputs(cfg, requests, mark)
        _COMPILED[key] = compile_model_on_fake_rank(
            model, args, options, rank=rank, world_size=world_size, token_inputs=marked
        )
    return _COMPILED[key]


def run_on_fake_rank(
    rank: int,
    options: dict[str, Any],
    cfg: ModelConfig | None = None,
    requests: Sequence[Request] = REQUESTS,
) -> torch.Tensor:
    """The logits of `cfg` (`compile_config()`) compiled with `dsv41_sp` under `options` as rank
    `rank` of a fake world of 8 and called on `requests`, the token count marked. Not kept, and
    not watched: a graph the host compiled before is loaded from its compile cache."""
    model, args, marked = _model_and_inputs(cfg or compile_config(), requests, True)
    return compiled_call(model, args, options, rank, 8, marked)


def _model_and_inputs(
    cfg: ModelConfig, requests: Sequence[Request], mark: bool
) -> tuple[DeepseekV41, tuple[Any, ...], tuple[torch.Tensor, ...]]:
    """The model (seed 0), its arguments for `requests` and the token inputs to mark."""
    torch.manual_seed(0)
    model = DeepseekV41(cfg)
    ids, positions, slots = pack(list(requests))
    marked = (ids, positions, slots) if mark else ()
    return model, (ids, positions, slots, model.new_cache(4, 32)), marked
