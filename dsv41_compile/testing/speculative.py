"""Decoding on real ranks: `decode_on_rank` runs `serving.generate` on one rank of a gloo
world with the backbone and the DSpark drafter compiled by `dsv41_sp`, the way a user decodes
under `torchrun` (every rank calls the same loop with the same prompts).

    results = RankPool.shared(8).run(decode_on_rank, DecodeSpec(...))
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from dsv41_compile.model import DeepseekV41, ModelConfig
from dsv41_compile.serving import generate

__all__ = ["DecodeSpec", "decode_on_rank"]


@dataclass(frozen=True)
class DecodeSpec:
    preset: str = "tiny-dspark"
    overrides: tuple[tuple[str, Any], ...] = ()
    prompts: tuple[tuple[int, ...], ...] = ()
    max_new_tokens: int = 40
    options: tuple[tuple[str, Any], ...] = (("tp", 4), ("ep", 8), ("lowering", "eager"))
    speculative: bool = True
    seed: int = 0


def model_of(spec: DecodeSpec) -> DeepseekV41:
    """The spec's model, the same on every rank and in the caller (seeded)."""
    torch.manual_seed(spec.seed)
    return DeepseekV41(ModelConfig.from_name(spec.preset, **dict(spec.overrides)))


def decode_on_rank(rank: int, world_size: int, spec: DecodeSpec) -> dict[str, Any]:
    """This rank's decode of `spec.prompts` with both programs compiled (`generate` marks each
    call's token counts): the tokens, the steps' figures and the decode's wall time (compiles
    included)."""
    model = model_of(spec)
    options = dict(spec.options)
    backbone = torch.compile(model, backend="dsv41_sp", options=options)
    drafter = None
    if spec.speculative:
        drafter = torch.compile(model.mtp, backend="dsv41_sp", options=options)
    start = time.perf_counter()
    out = generate(
        model,
        [list(p) for p in spec.prompts],
        spec.max_new_tokens,
        speculative=spec.speculative,
        backbone=backbone,
        drafter=drafter,
    )
    return {
        "tokens": out.tokens,
        "step_tokens": out.step_tokens,
        "step_accepted": out.step_accepted,
        "step_proposed": out.step_proposed,
        "seconds": time.perf_counter() - start,
    }
