"""The dsv41_sp-compiled DeepSeek V4.1 on 8 CPU ranks (gloo; tp=4, dp=2) against the
single-device model, step by step through the KV cache, with the communication table of one
rank's compiled graph.

Each DP group serves its own ragged batches: a prefill of requests of 3, 2 and 3 tokens, a
decode step, a multi-token decode step and a longer prefill next to decodes. Every rank runs the
compiled model and, on the same inputs, the plain single-device model, and reports the largest
logit difference.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from dsv41_compile.testing.cases import (
    SERVING_STEP_NAMES as KINDS,
)
from dsv41_compile.testing.cases import (
    SERVING_STEPS as STEPS,
)
from dsv41_compile.testing.cases import (
    CaseSpec,
    compare_on_rank,
)
from dsv41_compile.testing.multirank import run_ranks

WORLD, TP = 8, 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="ModelConfig preset (default: tiny)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--lowering", choices=("eager", "inductor"), default="eager")
    parser.add_argument(
        "--embedding", choices=("replicated", "vocab_sharded"), default="replicated"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as dump_dir:
        options = {"tp": TP, "lowering": args.lowering, "embedding": args.embedding}
        spec = CaseSpec(
            steps=STEPS,
            preset=args.preset,
            overrides=(("dtype", args.dtype),),
            options=(*options.items(), ("dump_dir", dump_dir)),
        )
        print(
            f"dsv41_sp: {args.preset} ({args.dtype}) on {WORLD} CPU ranks, tp={TP} dp={WORLD // TP}, "
            f"lowering={args.lowering}, embedding={args.embedding}; compiling on every rank..."
        )
        start = time.perf_counter()
        results = run_ranks(compare_on_rank, WORLD, spec)
        print(
            f"done in {time.perf_counter() - start:.0f} s (8 processes on this machine's cores)\n"
        )
        comm = json.loads((Path(dump_dir) / "rank0" / "comm.json").read_text())

    print(f"{'step':<20} {'DP group':>8} {'T':>4} {'max |compiled - single-device|':>32}")
    for i, kind in enumerate(KINDS):
        for dp in range(WORLD // TP):
            group = results[dp * TP : (dp + 1) * TP]
            T = group[0]["steps"][i]["T"]
            err = max(
                float((r["steps"][i]["sp"] - r["steps"][i]["ref"]).abs().max()) for r in group
            )
            print(f"{kind if dp == 0 else '':<20} {dp:>8} {T:>4} {err:>32.2e}")
    print(
        f"\ngraphs compiled per rank: {sorted({r['frames'] for r in results})} (one serves every T)"
    )

    print(
        "\ncommunication of rank 0 (from its rewritten graph; ring algorithms, T = DP group tokens)"
    )
    header = (
        f"{'layer':>5} {'kind':<15} {'dtype':<8} {'local input':<24} {'bytes sent (formula)':<24}"
    )
    print(header + "".join(f"{k:>9}" for k in comm["collectives"][0]["bytes_sent_at"]))
    for c in comm["collectives"]:
        layer = "-" if c["layer"] is None else c["layer"]
        shape = "[" + ", ".join(c["input_shape"]) + "]"
        row = f"{layer!s:>5} {c['kind']:<15} {c['dtype']:<8} {shape:<24} {c['bytes_sent']:<24}"
        print(row + "".join(f"{v:>9}" for v in c["bytes_sent_at"].values()))


if __name__ == "__main__":
    main()
