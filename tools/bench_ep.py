"""Expert-parallel dispatch on 8 CPU ranks (gloo; tp=4, dp=2, ep=8): bytes and step time of the
"exact" and "padded" lowerings, side by side on the same batches.

Every rank compiles the model twice (one per lowering) and then runs the scenarios alternately,
so both modes see the same machine state. Bytes come from each MoE layer's statistics output
(`EpLayer.step_record`): what a rank sent to other ranks in dispatch + combine, against what an
ideal dispatch (only the valid assignments) would send. Step times are medians over the
repeats; on 2 cores the 8 processes share the CPU, so the times measure the whole world's work.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

WORLD, TP, EP = 8, 4, 8
MODES = ("exact", "padded")


def scenarios(prefill: int) -> dict[str, list[list[Any]]]:
    """Per DP group: 4 requests; the decode and verification steps continue the prefill."""
    from dsv41_compile.testing.batches import Request

    def group(dp: int, tokens: int, start: int) -> list[Request]:
        ids = lambda s: [1 + (s * 7 + dp * 3 + i) % 500 for i in range(tokens)]  # noqa: E731
        return [Request(s, ids(s), start) for s in range(4)]

    groups = range(WORLD // TP)
    return {
        f"prefill (4 x {prefill})": [group(dp, prefill, 0) for dp in groups],
        "decode (4 x 1)": [group(dp, 1, prefill) for dp in groups],
        "verify (4 x 5)": [group(dp, 5, prefill + 1) for dp in groups],
    }


def run_rank(rank: int, world: int, preset: str, repeats: int, prefill: int) -> dict:
    import dsv41_compile
    from dsv41_compile.model import DeepseekV41, ModelConfig
    from dsv41_compile.testing.batches import pack
    from dsv41_compile.testing.capture import capture_lowered

    torch.manual_seed(0)
    model = DeepseekV41(ModelConfig.from_name(preset))
    cases = scenarios(prefill)
    compiled, programs, caches, compile_s = {}, {}, {}, {}
    first = next(iter(cases.values()))[rank // TP]
    for mode in MODES:
        torch._dynamo.reset()
        options = {"tp": TP, "ep": EP, "ep_dispatch": mode, "lowering": "eager"}
        compiled[mode] = torch.compile(model, backend="dsv41_sp", options=options, fullgraph=True)
        caches[mode] = model.new_cache(4, prefill + 8)
        ids, positions, slots = pack(first)
        dsv41_compile.mark_token_dim(ids, positions, slots)
        start = time.perf_counter()
        with capture_lowered() as lowered:
            compiled[mode](ids, positions, slots, caches[mode])
        compile_s[mode] = time.perf_counter() - start
        ((programs[mode], _ctx),) = lowered
    out: dict[str, Any] = {"compile_s": compile_s, "cases": {}}
    for name, batches in cases.items():
        ids, positions, slots = pack(batches[rank // TP])
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(repeats):
            for mode in MODES:  # alternate the modes
                dsv41_compile.mark_token_dim(ids, positions, slots)
                torch.distributed.barrier()
                start = time.perf_counter()
                compiled[mode](ids, positions, slots, caches[mode])
                torch.distributed.barrier()
                times[mode].append(time.perf_counter() - start)
        out["cases"][name] = {
            mode: {
                "T": int(ids.numel()),
                "median_s": statistics.median(times[mode]),
                "layers": [
                    layer.step_record(stats, programs[mode].ep_tokens)
                    for layer, stats in zip(programs[mode].ep_layers, programs[mode].ep_stats)
                ],
            }
            for mode in MODES
        }
    return out


def main() -> None:
    from dsv41_compile.testing.multirank import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefill", type=int, default=16, help="tokens per prefill request")
    args = parser.parse_args()
    print(f"{args.preset}, 8 ranks (tp={TP}, dp={WORLD // TP}, ep={EP}); compiling both modes...")
    results = run_ranks(run_rank, WORLD, args.preset, args.repeats, args.prefill)
    compile_s = {m: max(r["compile_s"][m] for r in results) for m in MODES}
    print(
        "compile + first call, slowest rank: "
        + ", ".join(f"{m} {s:.0f} s" for m, s in compile_s.items())
    )
    print(
        f"\n{'scenario':<18} {'mode':<7} {'T/group':>7} {'bytes/layer/rank':>16} "
        f"{'valid bytes':>11} {'ratio':>6} {'step ms':>8}"
    )
    for name in results[0]["cases"]:
        for mode in MODES:
            per_rank = [r["cases"][name][mode] for r in results]
            n_layers = len(per_rank[0]["layers"])
            sent = [
                sum(x["dispatch_bytes_sent"] + x["combine_bytes_sent"] for x in r["layers"])
                for r in per_rank
            ]
            valid = [
                sum(
                    x["valid_dispatch_bytes_sent"] + x["valid_combine_bytes_sent"]
                    for x in r["layers"]
                )
                for r in per_rank
            ]
            mean_sent = sum(sent) / WORLD / n_layers
            mean_valid = sum(valid) / WORLD / n_layers
            step_ms = 1e3 * max(r["median_s"] for r in per_rank)
            ratio = mean_sent / mean_valid if mean_valid else float("nan")
            print(
                f"{name if mode == MODES[0] else '':<18} {mode:<7} {per_rank[0]['T']:>7} "
                f"{mean_sent:>16.0f} {mean_valid:>11.0f} {ratio:>6.2f} {step_ms:>8.1f}"
            )
    print(
        "\nbytes: dispatch + combine a rank sends to other ranks, mean over ranks and MoE layers; "
        "valid: the same for exactly the valid assignments (an ideal dispatch); ratio = the "
        "lowering's overhead; step ms: slowest rank's median (barriers around each call)"
    )


if __name__ == "__main__":
    main()
