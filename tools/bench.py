"""Step time of the sp layout against the replicated baseline and the seed layout on 8 CPU
ranks, with both EP dispatch lowerings (or `--dispatch`), side by side on the same batches.

8 gloo processes (tp=4, dp=2, ep=8). The configurations: "sp" (the default options: the cuts
"auto" picks), "replicated" (the all-reduce baseline, the same EP options) and "seed" (the
seed's layout exactly: `attn_entry="input"`, `attn_exit="reduce_scatter"`,
`ep_rows="per_assignment"`).
Every rank compiles the model once per configuration (x EP dispatch) and then runs the scenarios with the configurations alternating, so all
see the same machine state: decode (4 requests x 1 token per DP group), dspark (16 requests x
5 tokens: a speculative verification batch) and prefill (2 requests x `--prefill` tokens).
Step time: the slowest rank's median over `--repeats` (a barrier before and after each call).
EP bytes: what a rank sent to the other ranks in dispatch + combine per MoE layer (from the
graph's statistics outputs), against an ideal dispatch of only the valid rows (with the
default `ep_rows="auto"`: one row per token and destination rank that holds one of its
experts; with "per_assignment", one per assignment). On 2
cores the 8 processes share the CPU, so a step time is the whole world's work.

    .venv/bin/python tools/bench.py --preset tiny --dim 256 --prefill 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from dsv41_compile.report.cli import run, tool_parser

WORLD, TP, EP = 8, 4, 8
LAYOUTS = ("seed", "sp", "replicated")


def configs(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(layout, EP dispatch, numerics): every layout in the model's numerics, or (`--numerics
    both`) sp in both numerics."""
    dispatches = ("exact", "padded") if args.dispatch == "both" else (args.dispatch,)
    if args.numerics == "both":
        return [("sp", d, n) for d in dispatches for n in ("bf16", "official")]
    return [(layout, d, args.numerics) for d in dispatches for layout in LAYOUTS]


def scenarios(prefill: int) -> dict[str, list[list[Any]]]:
    """Per DP group; decode and dspark rows sit after the prefill's positions."""
    from dsv41_compile.deepseek_v41.testing.batches import Request

    def group(dp: int, requests: int, tokens: int, start: int) -> list[Any]:
        ids = lambda s: [1 + (s * 7 + dp * 3 + i) % 500 for i in range(tokens)]  # noqa: E731
        return [Request(s, ids(s), start) for s in range(requests)]

    groups = range(WORLD // TP)
    return {
        "decode": [group(dp, 4, 1, prefill) for dp in groups],
        "dspark": [group(dp, 16, 5, prefill + 1) for dp in groups],
        "prefill": [group(dp, 2, prefill, 0) for dp in groups],
    }


def _progress(done: int, total: int, what: str) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what:<40}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def run_rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    import dsv41_compile
    from dsv41_compile.deepseek_v41.model import DeepseekV41
    from dsv41_compile.deepseek_v41.model.validate import validate_batch
    from dsv41_compile.deepseek_v41.testing.batches import pack
    from dsv41_compile.deepseek_v41.testing.presets import SEED_LAYOUT
    from dsv41_compile.testing.observe import capture_lowered

    models = {}
    for numerics in {config[2] for config in configs(args)}:
        torch.manual_seed(0)
        models[numerics] = DeepseekV41(model_config(args, numerics))
    cfg = next(iter(models.values())).cfg
    cases = scenarios(args.prefill)
    max_len = args.prefill + 8
    configs_ = configs(args)
    total = len(configs_) + len(cases) * args.repeats * len(configs_)
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if rank == 0:
            _progress(done, total, what)

    compiled, programs, caches, compile_s = {}, {}, {}, {}
    first = cases["prefill"][rank // TP]
    # One reset before all compiles: Dynamo keeps every configuration's graph on the model's
    # code object (a reset between them would throw the earlier ones away).
    torch._dynamo.reset()
    for config in configs_:
        layout, dispatch, numerics = config
        model = models[numerics]
        options = {
            "tp": TP,
            "ep": EP,
            "layout": layout,
            "ep_dispatch": dispatch,
            "lowering": args.lowering,
            **(SEED_LAYOUT if layout == "seed" else {}),
        }
        compiled[config] = torch.compile(model, backend="dsv41_sp", options=options, fullgraph=True)
        caches[config] = model.new_cache(16, max_len)
        ids, positions, slots = pack(first)
        dsv41_compile.mark_token_dim(ids, positions, slots)
        start = time.perf_counter()
        with capture_lowered() as lowered:
            compiled[config](ids, positions, slots, caches[config])
        compile_s[config] = time.perf_counter() - start
        (programs[config],) = lowered
        tick(f"compiled {'/'.join(config)}")
    out: dict[str, Any] = {"compile_s": compile_s, "cases": {}}
    for name, batches in cases.items():
        requests = batches[rank // TP]
        ids, positions, slots = pack(requests)
        # Each case is timed by replaying one step; it is checked against the cache it continues.
        continued = models[configs_[0][2]].new_cache(16, max_len)
        for request in requests:
            continued.lengths[request.slot] = request.start
        validate_batch(ids, positions, slots, continued, vocab_size=cfg.vocab_size)
        times: dict[tuple[str, str], list[float]] = {c: [] for c in configs_}
        for config in configs_:  # warm-up: the first call at a new T is not timed
            dsv41_compile.mark_token_dim(ids, positions, slots)
            compiled[config](ids, positions, slots, caches[config])
        for _ in range(args.repeats):
            for config in configs_:  # alternate the configurations
                dsv41_compile.mark_token_dim(ids, positions, slots)
                torch.distributed.barrier()
                start = time.perf_counter()
                compiled[config](ids, positions, slots, caches[config])
                torch.distributed.barrier()
                times[config].append(time.perf_counter() - start)
                tick(f"{name} {'/'.join(config)}")
        out["cases"][name] = {
            config: {
                "T": int(ids.numel()),
                "median_s": statistics.median(times[config]),
                "ep": [
                    layer.step_record(stats, programs[config].ep_tokens, rank)
                    for layer, stats in zip(
                        programs[config].spec.ep_layers, programs[config].ep_stats
                    )
                ],
            }
            for config in configs_
        }
    return out


def model_config(args: argparse.Namespace, numerics: str = "bf16"):
    """The preset (`--dim` wide); under the official numerics as the released checkpoint runs
    it: bf16, the weights held as released (so with `--numerics both` the bf16 side is bf16
    too, its weights dequantised)."""
    from dsv41_compile.deepseek_v41.model import ModelConfig

    cfg = ModelConfig.from_name(args.preset)
    if args.dim:
        cfg = cfg.replace(dim=args.dim)
    if numerics == "official" or args.numerics == "both":
        # wo_a's output rows split over tp in whole 32-row blocks of its FP8 scales
        o_lora_rank = max(cfg.o_lora_rank, 32 * TP // cfg.o_groups)
        cfg = cfg.replace(dtype="bfloat16", o_lora_rank=o_lora_rank)
    if numerics == "official":
        cfg = cfg.replace(numerics="official", weight_format="released")
    return cfg


def main() -> None:
    from dsv41_compile.testing.multirank import run_ranks

    parser = tool_parser(__doc__)
    parser.add_argument("--preset", default="tiny-swa")
    parser.add_argument("--dim", type=int, default=None, help="override the hidden size")
    parser.add_argument("--prefill", type=int, default=256, help="tokens per prefill request")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lowering", choices=("eager", "inductor"), default="eager")
    parser.add_argument("--dispatch", choices=("both", "exact", "padded"), default="both")
    parser.add_argument(
        "--numerics", choices=("bf16", "official", "both"), default="bf16",
        help="both: sp with the bf16 and the official numerics side by side (bf16 weights, "
        "against FP8 / FP4 weights and activations, quantised rows moved)",
    )  # fmt: skip
    args = parser.parse_args()
    from dsv41_compile.report.provenance import provenance

    print(provenance(), flush=True)  # the docs/benchmarks.md block's header
    configs_ = configs(args)
    cfg = model_config(args, configs_[0][2])
    print(
        f"{args.preset} (D={cfg.dim}, {cfg.n_layers} layers, {cfg.dtype}, o_lora_rank "
        f"{cfg.o_lora_rank}), 8 ranks (tp={TP}, "
        f"dp={WORLD // TP}, ep={EP}), {args.lowering} lowering, {args.repeats} repeats; "
        f"compiling {len(configs_)} configurations on every rank..."
    )
    results = run_ranks(run_rank, WORLD, args)
    print(
        "compile + first call, slowest rank: "
        + ", ".join(
            f"{'/'.join(c)} {max(r['compile_s'][c] for r in results):.0f} s" for c in configs_
        )
    )
    both = args.numerics == "both"
    print(
        f"\n{'scenario':<9} {'T/group':>7} {'layout':<11} {'EP':<7} {'numerics':<9} "
        f"{'step ms':>8} {'off/bf16' if both else 'sp/repl':>8} {'' if both else 'sp/seed':>8} "
        f"{'EP bytes/layer/rank':>20} {'/ valid':>8}"
    )
    for name in results[0]["cases"]:
        step_ms = {}
        for config in configs_:
            step_ms[config] = 1e3 * max(r["cases"][name][config]["median_s"] for r in results)
        for config in configs_:
            layout, dispatch, numerics = config
            per_rank = [r["cases"][name][config] for r in results]
            n_layers = max(len(per_rank[0]["ep"]), 1)
            sent = sum(
                x["dispatch_bytes_sent"] + x["combine_bytes_sent"]
                for r in per_rank
                for x in r["ep"]
            )
            valid = sum(
                x["valid_dispatch_bytes_sent"] + x["valid_combine_bytes_sent"]
                for r in per_rank
                for x in r["ep"]
            )
            if both:
                ratio = step_ms[config] / step_ms[(layout, dispatch, "bf16")]
                ratios = [f"{ratio:.2f}" if numerics == "official" else "", ""]
            else:
                ratios = [
                    f"{step_ms[config] / step_ms[(other, dispatch, numerics)]:.2f}"
                    if layout == "sp"
                    else ""
                    for other in ("replicated", "seed")
                ]
            overhead = f"{sent / valid:.2f}" if valid else "-"
            print(
                f"{name if config == configs_[0] else '':<9} {per_rank[0]['T']:>7} {layout:<11} "
                f"{dispatch:<7} {numerics:<9} {step_ms[config]:>8.1f} {ratios[0]:>8} "
                f"{ratios[1]:>8} "
                f"{sent / WORLD / n_layers:>20.0f} {overhead:>8}"
            )
    print(
        "\nstep ms: slowest rank's median; sp/repl, sp/seed: sp's step time over the replicated "
        "baseline's and the seed layout's with the same EP dispatch; off/bf16: the official "
        "numerics' over the bf16 numerics'; EP bytes: dispatch + combine sent to other ranks, "
        "mean over ranks and MoE layers; / valid: over an ideal dispatch of only the valid "
        "rows"
    )


if __name__ == "__main__":
    run(main)
