"""Write a synthetic checkpoint in the released DeepSeek V4.1 format from a seeded random model.

    python tools/make_checkpoint.py --preset tiny --out /tmp/tiny_ckpt

The directory gets (`deepseek_v41.testing.checkpoints.synthetic_checkpoint`) `config.json`,
`model.safetensors.index.json` and `--files` shards: FP8 attention projections and shared expert with e8m0 32 x 32 block scales,
FP4 routed experts with per-32 scales, the rest bf16 / fp32, under the released names. Read it
back with `ModelConfig.from_hf(out)` and `dsv41_compile.deepseek_v41.model.load_checkpoint(model, out)`.
"""

from __future__ import annotations

from pathlib import Path

from dsv41_compile.deepseek_v41.model import PRESETS, ModelConfig
from dsv41_compile.deepseek_v41.testing.checkpoints import synthetic_checkpoint
from dsv41_compile.report.cli import run, tool_parser


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("--preset", default="tiny", choices=[p for p in PRESETS if p != "flash"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--files", type=int, default=3)
    args = parser.parse_args()
    synthetic_checkpoint(
        ModelConfig.from_name(args.preset), args.out, seed=args.seed, files=args.files
    )
    shards = sorted(args.out.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in shards)
    print(f"{args.out}: config.json, index, {len(shards)} shards, {size / 2**20:.2f} MiB")


if __name__ == "__main__":
    run(main)
