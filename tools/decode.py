"""Decode with DeepSeek V4.1, plainly or speculatively with its DSpark drafter
(`dsv41_compile.deepseek_v41.serving.generate`), and print the tokens, tokens per step and acceptance.

On one process the modules run eagerly; under `torchrun` every rank joins a gloo group and
runs the backbone and the drafter compiled by `dsv41_sp` (`--tp`, `--ep`). `--compare` decodes
the same prompts twice, plainly then speculatively, and prints both side by side: tokens per
second, time per verify (backbone) call and per draft call, acceptance, and whether the greedy
tokens agree.

    .venv/bin/python tools/decode.py --checkpoint DIR --prompt "1,2,3" --max-new-tokens 64
    .venv/bin/python tools/decode.py --preset tiny-dspark --prompts 3 --max-new-tokens 40
    .venv/bin/torchrun --nproc-per-node 8 tools/decode.py --preset tiny-dspark --compare

With a preset the weights are random (seeded): the drafter then proposes poorly and few
proposals are kept. A checkpoint's `tokenizer.json`, if it has one, decodes the tokens to text
(`--text`); prompts are token ids.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig, load_checkpoint
from dsv41_compile.deepseek_v41.serving import Decoded, generate
from dsv41_compile.report.cli import run, tool_parser
from dsv41_compile.report.provenance import provenance


def build(args: argparse.Namespace) -> DeepseekV41:
    if args.checkpoint:
        cfg = ModelConfig.from_hf(args.checkpoint, skip_unimplemented_parts=True)
        model = DeepseekV41.without_weights(cfg)
        load_checkpoint(model, args.checkpoint, skip_unimplemented_parts=True)
        return model
    torch.manual_seed(args.seed)
    overrides = {"hc_sinkhorn_iters": args.sinkhorn} if args.sinkhorn else {}
    return DeepseekV41(ModelConfig.from_name(args.preset, **overrides))


def prompts_of(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    if args.prompt:
        return [[int(t) for t in p.split(",")] for p in args.prompt]
    g = torch.Generator().manual_seed(args.seed + 1)
    lengths = [3 + (5 * i) % 11 for i in range(args.prompts)]
    return [torch.randint(0, vocab - 1, (n,), generator=g).tolist() for n in lengths]


def decode(args, model, prompts, speculative: bool, programs, rank: int) -> Decoded:
    backbone, drafter = programs
    total = len(prompts) * args.max_new_tokens
    label = "speculative" if speculative else "plain"
    with tqdm(total=total, desc=label, unit="tok", disable=rank != 0 or args.quiet) as bar:
        return generate(
            model,
            prompts,
            args.max_new_tokens,
            speculative=speculative,
            temperature=args.temperature,
            generator=torch.Generator().manual_seed(args.seed + 2),
            backbone=backbone,
            drafter=drafter if speculative else None,
            on_step=bar.update,
        )


def summary(label: str, out: Decoded, seconds: float) -> str:
    """One line: the whole run, then the steps after the first (whose calls compile)."""
    tokens = sum(len(t) for t in out.tokens)
    first = out.backbone_seconds[0] + (out.drafter_seconds[0] if out.drafter_seconds else 0.0)
    later = sum(out.step_tokens[1:])
    verify = out.backbone_seconds[1:] or [0.0]
    line = (
        f"{label:<12} {tokens} tokens in {len(out.step_tokens)} steps, {seconds:.2f} s; the "
        f"first step (prefill, compiles) {first:.2f} s, then {later} tokens at "
        f"{later / max(seconds - first, 1e-9):.1f} tok/s; per backbone call "
        f"{1e3 * sum(verify) / len(verify):.1f} ms"
    )
    if out.drafter_seconds:
        draft = out.drafter_seconds[1:] or out.drafter_seconds
        line += (
            f", per draft call {1e3 * sum(draft) / len(draft):.1f} ms; kept "
            f"{sum(out.step_accepted)} of {sum(out.step_proposed)} proposals "
            f"({100 * out.acceptance:.1f} %), {out.tokens_per_step:.2f} tokens per request and step"
        )
    return line


def main() -> None:
    parser = tool_parser(__doc__)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", help="a checkpoint directory (config.json and shards)")
    source.add_argument("--preset", default="tiny-dspark", help="random weights of a preset")
    parser.add_argument("--prompt", action="append", help="token ids, comma separated; repeatable")
    parser.add_argument("--prompts", type=int, default=3, help="random prompts, without --prompt")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--no-draft", action="store_true", help="plain decoding only")
    parser.add_argument("--compare", action="store_true", help="plain, then speculative")
    parser.add_argument("--tp", type=int, default=4, help="under torchrun")
    parser.add_argument("--ep", type=int, default=8, help="under torchrun: 1 or the world size")
    parser.add_argument("--lowering", default="eager", help="under torchrun: eager or inductor")
    parser.add_argument("--sinkhorn", type=int, default=0, help="mHC Sinkhorn iterations (preset)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text", action="store_true", help="decode with tokenizer.json")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args()

    rank, world = 0, int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1 if world > 1 else torch.get_num_threads())
    model = build(args)
    programs = (None, None)
    if world > 1:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        options = {"tp": args.tp, "ep": args.ep, "lowering": args.lowering}
        backbone = torch.compile(model, backend="dsv41_sp", options=options)
        drafter = None
        if model.cfg.num_nextn_predict_layers:
            drafter = torch.compile(model.mtp, backend="dsv41_sp", options=options)
        programs = (backbone, drafter)
    prompts = prompts_of(args, model.cfg.vocab_size)
    runs = [False, True] if args.compare else [not args.no_draft]
    results = {}
    for speculative in runs:
        start = time.perf_counter()
        out = decode(args, model, prompts, speculative, programs, rank)
        results[speculative] = (out, time.perf_counter() - start)
    if rank == 0:
        print(provenance())  # the docs/benchmarks.md block's header
        where = (
            f"{world} ranks (tp={args.tp}, ep={args.ep}, {args.lowering})"
            if world > 1
            else "1 process, eager"
        )
        print(f"{args.checkpoint or args.preset}: {len(prompts)} requests, {where}")
        tokenizer = None
        if args.text and args.checkpoint:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(Path(args.checkpoint) / "tokenizer.json"))
        out, _ = results[runs[-1]]
        for i, tokens in enumerate(out.tokens):
            shown = tokenizer.decode(tokens) if tokenizer else tokens
            print(f"  request {i} (prompt of {len(prompts[i])}): {shown}")
        for speculative, (out, seconds) in results.items():
            print(summary("speculative" if speculative else "plain", out, seconds))
        if args.compare and args.temperature == 0:
            same = results[False][0].tokens == results[True][0].tokens
            print(f"greedy tokens identical with and without drafts: {same}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    run(main)
