"""Write a synthetic checkpoint in the released DeepSeek V4.1 format from a seeded random model.

    python tools/make_checkpoint.py --preset tiny --out /tmp/tiny_ckpt

The directory gets `config.json` (`hf_config.config_to_hf`), `model.safetensors.index.json` and
`--files` shards: FP8 attention projections and shared expert with e8m0 32 x 32 block scales,
FP4 routed experts with per-32 scales, the rest bf16 / fp32, under the released names. Read it
back with `ModelConfig.from_hf(out)` and `dsv41_compile.model.load_checkpoint(model, out)`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dsv41_compile.model import PRESETS, DeepseekV41, ModelConfig
from dsv41_compile.models.deepseek_v41.checkpoint import write_checkpoint
from dsv41_compile.models.deepseek_v41.hf_config import config_to_hf


def make_checkpoint(cfg: ModelConfig, out: Path, *, seed: int = 0, files: int = 3) -> DeepseekV41:
    """The seeded model `cfg` describes, written to `out`; returns the model."""
    torch.manual_seed(seed)
    model = DeepseekV41(cfg)
    write_checkpoint(model, out, files=files)
    (out / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=[p for p in PRESETS if p != "flash"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--files", type=int, default=3)
    args = parser.parse_args()
    make_checkpoint(ModelConfig.from_name(args.preset), args.out, seed=args.seed, files=args.files)
    shards = sorted(args.out.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in shards)
    print(f"{args.out}: config.json, index, {len(shards)} shards, {size / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
