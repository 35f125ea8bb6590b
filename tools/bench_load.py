"""Load time and throughput of `load_checkpoint` against a plain sequential read of the same
shard files, side by side in one run (alternating, the files in the page cache for both).

    python tools/bench_load.py --preset tiny-swa --dim 1024 --inter 1024 --repeats 5
    python tools/bench_load.py --preset tiny-swa --dim 1024 --inter 1024 --tp 4 --ep 8

Single-device loading: the whole model is read and decoded (FP8 / FP4 to the model's dtype).
With `--tp` / `--ep`: each rank of the world (tp x dp = ep, or 8 ranks with ep = 1) reads only
its slices, as the backend's `checkpoint` option does (`checkpoint.read_weights`), one rank
after another in this process; the table gives each rank's bytes read and time. The synthetic
checkpoint is written first (`deepseek_v41.testing.checkpoints`) into `--dir`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig, load_checkpoint
from dsv41_compile.deepseek_v41.model.checkpoint import read_weights
from dsv41_compile.deepseek_v41.testing.checkpoints import rank_weight_inputs, synthetic_checkpoint
from dsv41_compile.report.cli import run, tool_parser
from dsv41_compile.report.provenance import provenance


def _sequential_read(files: list[Path]) -> int:
    size = 0
    for path in files:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                size += len(chunk)
    return size


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--dim", type=int, help="override the preset's hidden size")
    parser.add_argument("--inter", type=int, help="override the experts' intermediate size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, help="where the checkpoint is written (a temp dir)")
    parser.add_argument("--tp", type=int, help="per-rank loading: the tp group size")
    parser.add_argument("--ep", type=int, default=1, help="per-rank loading: 1 or the world")
    args = parser.parse_args()
    print(provenance(), flush=True)  # the docs/benchmarks.md block's header
    sizes = {"dim": args.dim, "moe_inter_dim": args.inter}
    cfg = ModelConfig.from_name(
        args.preset, dtype=args.dtype, **{k: v for k, v in sizes.items() if v}
    )
    out = args.dir or Path(tempfile.mkdtemp(prefix="dsv41_ckpt_"))
    synthetic_checkpoint(cfg, out)
    files = sorted(out.glob("*.safetensors"))
    if args.tp is not None:
        per_rank(cfg, out, files, args)
        return
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


def per_rank(cfg: ModelConfig, out: Path, files: list[Path], args: argparse.Namespace) -> None:
    world = max(args.ep, 8)
    options = {"tp": args.tp, "ep": args.ep}
    whole = sum(f.stat().st_size for f in files)
    print(f"{args.preset} (dim {cfg.dim}, experts {cfg.moe_inter_dim}, {args.dtype}), "
          f"{whole / 2**20:.2f} MiB in {len(files)} shards, {options}, median of "
          f"{args.repeats}, each rank beside a sequential read of all the files:")  # fmt: skip
    print(f"  {'rank':>4} {'read MiB':>9} {'of all':>7} {'load s':>8} {'GB/s':>7} "
          f"{'all files s':>12} {'GB/s':>7}")  # fmt: skip
    for rank in range(world):
        inputs = rank_weight_inputs(cfg, options, rank)
        load_s, read_s, read = [], [], 0
        for _ in range(args.repeats):
            start = time.perf_counter()
            _, per_tensor = read_weights(out, inputs)
            load_s.append(time.perf_counter() - start)
            read = sum(per_tensor.values())
            start = time.perf_counter()
            raw = _sequential_read(files)
            read_s.append(time.perf_counter() - start)
        load, seq = statistics.median(load_s), statistics.median(read_s)
        print(f"  {rank:>4} {read / 2**20:>9.2f} {read / whole:>7.1%} {load:>8.3f} "
              f"{read / load / 1e9:>7.3f} {seq:>12.4f} {raw / seq / 1e9:>7.2f}")  # fmt: skip


if __name__ == "__main__":
    run(main)
