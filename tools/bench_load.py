"""Load time and throughput of `load_checkpoint` against a plain sequential read of the same
shard files, side by side in one run (alternating, the files in the page cache for both).

    python tools/bench_load.py --preset tiny-swa --dim 1024 --inter 1024 --repeats 5

Single-device loading: the whole model is read and decoded (FP8 / FP4 to the model's dtype).
The synthetic checkpoint is written first (`testing.checkpoints`) into `--dir`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dsv41_compile.model import DeepseekV41, ModelConfig, load_checkpoint
from dsv41_compile.testing.checkpoints import synthetic_checkpoint


def _sequential_read(files: list[Path]) -> int:
    size = 0
    for path in files:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                size += len(chunk)
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--dim", type=int, help="override the preset's hidden size")
    parser.add_argument("--inter", type=int, help="override the experts' intermediate size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, help="where the checkpoint is written (a temp dir)")
    args = parser.parse_args()
    sizes = {"dim": args.dim, "moe_inter_dim": args.inter}
    cfg = ModelConfig.from_name(
        args.preset, dtype=args.dtype, **{k: v for k, v in sizes.items() if v}
    )
    out = args.dir or Path(tempfile.mkdtemp(prefix="dsv41_ckpt_"))
    synthetic_checkpoint(cfg, out)
    files = sorted(out.glob("*.safetensors"))
    torch.manual_seed(1)
    model = DeepseekV41(cfg)
    load_s, read_s, loaded, raw = [], [], 0, 0
    for _ in range(args.repeats):
        start = time.perf_counter()
        loaded = sum(load_checkpoint(model, out).values())
        load_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        raw = _sequential_read(files)
        read_s.append(time.perf_counter() - start)
    load, read = statistics.median(load_s), statistics.median(read_s)
    print(
        f"{args.preset} (dim {cfg.dim}, experts {cfg.moe_inter_dim}, {args.dtype}), "
        f"{len(files)} shards in {out}, median of {args.repeats}:"
    )
    print(f"  load_checkpoint  {loaded / 2**20:8.2f} MiB of tensors  {load:7.3f} s  "
          f"{loaded / load / 1e9:6.3f} GB/s")  # fmt: skip
    print(f"  sequential read  {raw / 2**20:8.2f} MiB of files    {read:7.3f} s  "
          f"{raw / read / 1e9:6.3f} GB/s")  # fmt: skip
    print(f"  load / read time: {load / read:.1f}x")


if __name__ == "__main__":
    main()
