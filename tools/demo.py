"""The dsv41_sp-compiled DeepSeek V4.1 on 8 CPU ranks (gloo; tp=4, dp=2, ep=8) against the
single-device model, step by step through the KV cache, with the communication table of one
rank's compiled graph and the expert-parallel traffic of every step.

Each DP group serves its own ragged batches: a prefill of requests of 3, 2 and 3 tokens, a
decode step, a multi-token decode step, a longer prefill next to decodes, and a step in which DP
group 0 is idle (T = 0) while group 1 decodes. Every rank checks each batch against its cache
(`validate_batch`), runs the compiled model and, on the same inputs, the plain single-device
model, and reports the largest logit difference.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from torch import Tensor

from dsv41_compile.deepseek_v41.model import ModelConfig
from dsv41_compile.deepseek_v41.testing.cases import (
    SERVING_STEP_NAMES as KINDS,
)
from dsv41_compile.deepseek_v41.testing.cases import (
    SERVING_STEPS as STEPS,
)
from dsv41_compile.deepseek_v41.testing.cases import (
    CaseSpec,
    compare_on_rank,
)
from dsv41_compile.deepseek_v41.testing.checkpoints import synthetic_checkpoint
from dsv41_compile.report.cli import run, tool_parser
from dsv41_compile.testing.multirank import run_ranks

WORLD, TP, EP = 8, 4, 8


def max_diff(a: Tensor, b: Tensor) -> float:
    """max |a - b|, 0 for an idle group's empty logits."""
    return float((a - b).abs().max()) if a.numel() else 0.0


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("--preset", default="tiny", help="ModelConfig preset (default: tiny)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--lowering", choices=("eager", "inductor"), default="eager")
    parser.add_argument(
        "--embedding", choices=("replicated", "vocab_sharded"), default="replicated"
    )
    parser.add_argument("--ep", type=int, choices=(1, EP), default=EP)
    parser.add_argument("--ep-dispatch", choices=("exact", "padded"), default="exact")
    parser.add_argument(
        "--layout", choices=("sp", "replicated"), default="sp", help="replicated: the baseline"
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        help="compile DeepseekV41.without_weights with this checkpoint directory (the released "
        "format), each rank reading its own slices, against the single-device model loaded from "
        "it (or "
        "'synthetic': write one from a seeded model first, as tools/make_checkpoint.py does)",
    )
    args = parser.parse_args()
    checkpoint = args.checkpoint
    if checkpoint is not None and str(checkpoint) == "synthetic":
        checkpoint = Path(tempfile.mkdtemp(prefix="dsv41_ckpt_"))
        synthetic_checkpoint(
            ModelConfig.from_name(args.preset, dtype=args.dtype), checkpoint, seed=1
        )
        print(f"wrote a synthetic checkpoint of {args.preset} to {checkpoint}")

    options = {
        "tp": TP,
        "ep": args.ep,
        "ep_dispatch": args.ep_dispatch,
        "layout": args.layout,
        "lowering": args.lowering,
        "embedding": args.embedding,
    }
    spec = CaseSpec(
        steps=STEPS,
        preset=args.preset,
        overrides=(("dtype", args.dtype),),
        options=tuple(options.items()),
        dump=True,
        checkpoint=None if checkpoint is None else str(checkpoint),
    )
    print(
        f"dsv41_sp ({args.layout} layout): {args.preset} ({args.dtype}) on {WORLD} CPU ranks, "
        f"tp={TP} dp={WORLD // TP} "
        f"ep={args.ep} ({args.ep_dispatch} dispatch), lowering={args.lowering}, "
        f"embedding={args.embedding}; compiling (one rank per host, the others load it)..."
    )
    start = time.perf_counter()
    results = run_ranks(compare_on_rank, WORLD, spec)
    print(f"done in {time.perf_counter() - start:.0f} s (8 processes on this machine's cores)")
    if checkpoint is not None:
        read = [sum(r["checkpoint_read"].values()) for r in results]
        whole = sum(results[0]["reference_read"].values())
        print(f"each rank's program read its own slices of {checkpoint}: {min(read)} to "
              f"{max(read)} bytes of its {whole} (the single-device reference read all of it)")  # fmt: skip
    print()
    comm = results[0]["comm"]

    print(f"{'step':<20} {'DP group':>8} {'T':>4} {'max |compiled - single-device|':>32}")
    for i, kind in enumerate(KINDS):
        for dp in range(WORLD // TP):
            group = results[dp * TP : (dp + 1) * TP]
            T = group[0]["T"][i]
            err = max(max_diff(r["modes"]["marked"]["logits"][i], r["ref"][i]) for r in group)
            print(f"{kind if dp == 0 else '':<20} {dp:>8} {T:>4} {err:>32.2e}")
    compiles = sorted({r["modes"]["marked"]["compiles"] for r in results})
    shared = sum(r["host_cache"].get("loaded", 0) for r in results)
    print(
        f"\nprograms compiled per rank: {compiles} (mark_token_dim: one serves every T); "
        f"{shared} of {WORLD} ranks loaded their program from the host's compile cache"
    )

    print(
        "\ncommunication of rank 0 (from its rewritten graph; ring all-gather / reduce-scatter / "
        "all-reduce, pairwise all-to-all; T = DP group tokens)"
    )
    at = list(comm["collectives"][0]["bytes_sent_at"])
    header = f"{'layer':>5} {'kind':<11} {'axis':<4} {'dtype':<8} {'local input':<24} "
    print(header + f"{'bytes sent (formula)':<26}" + "".join(f"{k:>9}" for k in at))
    for c in comm["collectives"]:
        layer = "-" if c["layer"] is None else c["layer"]
        shape = "[" + ", ".join(c["input_shape"]) + "]"
        shape = shape if len(shape) <= 24 else shape[:21] + "..."
        row = f"{layer!s:>5} {c['kind']:<11} {c['axis']:<4} {c['dtype']:<8} {shape:<24} "
        values = c["bytes_sent_at"] or dict.fromkeys(at, "-")
        print(row + f"{c['bytes_sent']:<26}" + "".join(f"{v:>9}" for v in values.values()))

    if comm["ep_layers"]:
        print(
            "\nexpert-parallel traffic of layer 0, measured (comm.json ep_steps): valid routed "
            "assignments dispatched by all 8 ranks, the rows that carried them "
            f"({comm['ep_layers'][0]['why']}), and the dispatch + combine bytes they sent"
        )
        print(f"{'step':<20} {'assignments':>11} {'rows':>6} {'bytes sent':>11} {'overhead':>9}")
        for i, kind in enumerate(KINDS):
            layers = [r["comm"]["ep_steps"][i]["layers"][0] for r in results]
            sent = sum(x["dispatch_bytes_sent"] + x["combine_bytes_sent"] for x in layers)
            useful = sum(
                x["valid_dispatch_bytes_sent"] + x["valid_combine_bytes_sent"] for x in layers
            )
            assignments = sum(x["assignments_sent"] for x in layers)
            rows = sum(sum(x["rows_sent_per_rank"]) for x in layers)
            print(f"{kind:<20} {assignments:>11} {rows:>6} {sent:>11} {sent - useful:>9}")


if __name__ == "__main__":
    run(main)
