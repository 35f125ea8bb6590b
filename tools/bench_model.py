"""Single-device tokens/s of the DeepSeek V4.1 model: batched prefill and batched decode.

Prefill: one batch of `--prefill-requests` × `--prefill-len` tokens into an empty cache.
Decode: `--decode-requests` requests, each holding a `--decode-prefix`-token prompt (untimed),
decode one token per step for `--decode-steps` steps. Each measurement is the median of
`--repeats` runs after one warm-up run (which also compiles, with `--compile`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig
from dsv41_compile.deepseek_v41.model.cache import KVCache
from dsv41_compile.deepseek_v41.testing.batches import Request, pack
from dsv41_compile.report.cli import run, tool_parser
from dsv41_compile.report.provenance import provenance

Forward = Callable[[Tensor, Tensor, Tensor, KVCache], Tensor]


def packed_batch(
    num_requests: int, start: int, length: int, vocab_size: int, gen: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """`length` tokens per request at positions `start..start+length-1`, request r in slot r."""
    ids = torch.randint(0, vocab_size, (num_requests, length), generator=gen).tolist()
    return pack([Request(r, ids[r], start) for r in range(num_requests)])


def time_prefill(
    model: DeepseekV41, forward: Forward, args: argparse.Namespace, vocab_size: int
) -> float:
    """Seconds for one prefill batch into a fresh cache."""
    gen = torch.Generator().manual_seed(0)
    batch = packed_batch(args.prefill_requests, 0, args.prefill_len, vocab_size, gen)
    cache = model.new_cache(num_slots=args.prefill_requests, max_len=args.prefill_len)
    start = time.perf_counter()
    forward(*batch, cache)
    return time.perf_counter() - start


def time_decode(
    model: DeepseekV41, forward: Forward, args: argparse.Namespace, vocab_size: int
) -> float:
    """Seconds for `decode_steps` one-token-per-request steps after an untimed prefill."""
    gen = torch.Generator().manual_seed(0)
    n, prefix = args.decode_requests, args.decode_prefix
    cache = model.new_cache(num_slots=n, max_len=prefix + args.decode_steps)
    forward(*packed_batch(n, 0, prefix, vocab_size, gen), cache)
    steps = [packed_batch(n, prefix + i, 1, vocab_size, gen) for i in range(args.decode_steps)]
    start = time.perf_counter()
    for batch in steps:
        forward(*batch, cache)
    return time.perf_counter() - start


def median_seconds(run: Callable[[], float], repeats: int) -> float:
    run()  # warm-up (and compilation)
    return statistics.median(run() for _ in range(repeats))


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("--preset", default="tiny", help="ModelConfig preset (default: tiny)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    parser.add_argument("--prefill-requests", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=64)
    parser.add_argument("--decode-requests", type=int, default=8)
    parser.add_argument("--decode-prefix", type=int, default=16)
    parser.add_argument("--decode-steps", type=int, default=32)
    args = parser.parse_args()
    print(provenance(), flush=True)  # the docs/benchmarks.md block's header

    cfg = dataclasses.replace(ModelConfig.from_name(args.preset), dtype=args.dtype)
    torch.manual_seed(0)
    model = DeepseekV41(cfg).eval()
    modes: list[tuple[str, Forward]] = [("eager", model)]
    if args.compile:
        modes.append(("compile", torch.compile(model, fullgraph=True)))

    print(
        f"preset={args.preset} dtype={cfg.dtype} threads={torch.get_num_threads()} "
        f"repeats={args.repeats} (median after 1 warm-up)"
    )
    print(f"{'mode':<8} {'phase':<8} {'batch':>8} {'steps':>6} {'median ms':>10} {'tokens/s':>10}")
    phases = [  # (name, timer, requests, tokens per request per step, steps)
        ("prefill", time_prefill, args.prefill_requests, args.prefill_len, 1),
        ("decode", time_decode, args.decode_requests, 1, args.decode_steps),
    ]
    with torch.inference_mode():
        for mode, forward in modes:
            for phase, timer, requests, length, steps in phases:
                run = functools.partial(timer, model, forward, args, cfg.vocab_size)
                seconds = median_seconds(run, args.repeats)
                print(
                    f"{mode:<8} {phase:<8} {f'{requests}x{length}':>8} {steps:>6} "
                    f"{seconds * 1e3:>10.1f} {requests * length * steps / seconds:>10.0f}"
                )


if __name__ == "__main__":
    run(main)
