"""Decoding on real ranks: `decode_on_rank` runs `serving.generate` on one rank of a gloo
world with the backbone and the DSpark drafter compiled by `dsv41_sp`, the way a user decodes
under `torchrun` (every rank calls the same loop with the same prompts).

    results = RankPool.shared(8).run(decode_on_rank, DecodeSpec(...))
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from dsv41_compile.deepseek_v41.adapter import DeepseekV41Adapter
from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig, load_checkpoint
from dsv41_compile.deepseek_v41.serving import generate
from dsv41_compile.runtime.program import ShardedProgram
from dsv41_compile.testing.observe import capture_lowered

__all__ = ["DecodeSpec", "decode_on_rank"]


@dataclass(frozen=True)
class DecodeSpec:
    preset: str = "tiny-dspark"
    overrides: tuple[tuple[str, Any], ...] = ()
    checkpoint: str | None = None
    """A checkpoint directory to load the model from (its config with `overrides`), instead of
    the preset's seeded weights."""
    prompts: tuple[tuple[int, ...], ...] = ()
    max_new_tokens: int = 40
    options: tuple[tuple[str, Any], ...] = (("tp", 4), ("ep", 8), ("lowering", "eager"))
    speculative: bool = True
    seed: int = 0


def model_of(spec: DecodeSpec) -> DeepseekV41:
    """The spec's model, the same on every rank and in the caller (seeded, or loaded)."""
    if spec.checkpoint is not None:
        cfg = ModelConfig.from_hf(spec.checkpoint, **dict(spec.overrides))
        model = DeepseekV41.without_weights(cfg)
        load_checkpoint(model, spec.checkpoint)
        return model
    torch.manual_seed(spec.seed)
    return DeepseekV41(ModelConfig.from_name(spec.preset, **dict(spec.overrides)))


def decode_on_rank(rank: int, world_size: int, spec: DecodeSpec) -> dict[str, Any]:
    """This rank's decode of `spec.prompts` with both programs compiled (`generate` marks each
    call's token counts): the tokens, the steps' figures, the decode's wall time (compiles
    included) and, per program made, its collectives (`collectives`). The programs are read as
    the backend made them (`capture_lowered`), so the host's ranks share each compile
    (`runtime.host_cache`) as they do for a user."""
    model = model_of(spec)
    options = dict(spec.options)
    backbone = torch.compile(model, backend="dsv41_sp", options=options)
    drafter = None
    if spec.speculative:
        drafter = torch.compile(model.mtp, backend="dsv41_sp", options=options)
    start = time.perf_counter()
    with capture_lowered() as programs:
        out = generate(
            model,
            [list(p) for p in spec.prompts],
            spec.max_new_tokens,
            speculative=spec.speculative,
            backbone=backbone,
            drafter=drafter,
        )
    return {
        "programs": [collectives(program) for program in programs],
        "tokens": out.tokens,
        "step_tokens": out.step_tokens,
        "step_accepted": out.step_accepted,
        "step_proposed": out.step_proposed,
        "seconds": time.perf_counter() - start,
        "backbone_seconds": out.backbone_seconds,
        "drafter_seconds": out.drafter_seconds,
    }


def collectives(program: ShardedProgram) -> dict[str, Any]:
    """A per-rank program's collectives: `{"drafter": is it the drafter's, "by_part": {(layer,
    part, kind): count}}` (the layer None outside the layers; kinds as `comm.json` names them)."""
    fqns = {p.fqn for p in program.signature.params}
    adapter = DeepseekV41Adapter()
    found: Counter[tuple[int | None, str, str]] = Counter()
    for record in program.spec.comm:
        site = adapter.site(record["region"])
        found[(site.layer, site.part, record["kind"])] += 1
    return {"drafter": "main_proj.weight" in fqns, "by_part": dict(found)}
