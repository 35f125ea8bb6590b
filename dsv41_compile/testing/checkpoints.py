"""Synthetic checkpoints in the released format, for tests, the demo and the tools.

    model = synthetic_checkpoint(cfg, out_dir, seed=1)   # the seeded model that was written

`out_dir` gets `config.json` (`hf_config.config_to_hf`), `model.safetensors.index.json` and
`files` shards (`checkpoint.write_checkpoint`: FP8 / FP4 with their scales under the released
names); `ModelConfig.from_hf(out_dir)` and `load_checkpoint(model, out_dir)` read it back.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dsv41_compile.model import DeepseekV41, ModelConfig
from dsv41_compile.models.deepseek_v41.checkpoint import write_checkpoint
from dsv41_compile.models.deepseek_v41.hf_config import config_to_hf

__all__ = ["synthetic_checkpoint"]


def synthetic_checkpoint(
    cfg: ModelConfig, out: str | Path, *, seed: int = 0, files: int = 3
) -> DeepseekV41:
    """The model `cfg` describes, built with seed `seed`, written to `out` (created) as a
    checkpoint of `files` shards with its config; returns the model."""
    out = Path(out)
    torch.manual_seed(seed)
    model = DeepseekV41(cfg)
    write_checkpoint(model, out, files=files)
    (out / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2))
    return model
