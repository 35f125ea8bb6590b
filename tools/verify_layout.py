"""Check a layout on the ranks you launch, one node or several: every rank compiles a preset
model with `dsv41_sp` in that layout, serves three steps through the cache (a prefill, a decode
of uneven DP groups, a step with DP group 0 idle) and compares its logits and cache with the
single-device model's on the same inputs (seeded weights, the fp32 bound); rank 0 prints one
line per rank -- its node, whether it compiled or loaded its programs, its collectives per
layer, its largest differences -- and the command exits non-zero where a rank differs.

    torchrun --nproc-per-node 8 tools/verify_layout.py --tp 4 --ep 8
    # two nodes of 4 ranks (on the second, --node-rank 1; the address is node 0's):
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr HOST --master-port 29500 \\
        tools/verify_layout.py --tp 4 --ep 8

With `--decode-tp`, the same model is also compiled at that tp and the check is prefill and
decode in two layouts (`serving.Split`): each rank prefills its DP group's requests at `--tp`,
keeps its decode group's share (`serving.hand_over`), decodes them at `--decode-tp` against the
single-device model, and `generate(..., split=...)` is compared with one device's greedy
tokens (`deepseek_v41.testing.split`).

The ranks join a gloo group and run on CPU (the comparison's single-device side runs on every
rank too), so this checks the compiler's program and the launch -- ranks, nodes, the host
cache's one compile per node -- not a device's kernels. DP group g serves requests of its own
(`deepseek_v41.testing.cases.serving_steps`); every TP group is `--tp` consecutive ranks, so
with `--tp` dividing the ranks per node each TP group stays within a node and the EP
all-to-alls cross nodes.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dsv41_compile.deepseek_v41.testing.cases import (
    CaseSpec,
    compare_on_rank,
    model_config,
    serving_steps,
)
from dsv41_compile.deepseek_v41.testing.split import SplitSpec, split_on_rank
from dsv41_compile.report.cli import run, tool_parser
from dsv41_compile.runtime.host_cache import node_id

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
"""The fp32 bound of the multi-rank tests."""


def rank_summary(rank: int, world: int, spec: CaseSpec) -> dict[str, Any]:
    """This rank's comparison, reduced to what rank 0 prints: per step, the largest logit
    difference and whether it is within `TOLERANCE`; the cache's largest difference."""
    result = compare_on_rank(rank, world, spec)
    (mode, out), *_ = result["modes"].items()
    steps = []
    for got, want in zip(out["logits"], result["ref"]):
        try:
            torch.testing.assert_close(got, want, atol=TOLERANCE["atol"], rtol=TOLERANCE["rtol"])
            ok = True
        except AssertionError:
            ok = False
        error = float((got - want).abs().max()) if want.numel() else 0.0
        steps.append({"rows": int(want.shape[0]), "max_abs_err": error, "ok": ok})
    return {
        "rank": rank,
        "node": node_id(),
        "mode": mode,
        "steps": steps,
        "cache_diff": out["cache_diff"],
        "cache_ok": out["cache_diff"] <= TOLERANCE["atol"],
        "programs": out["compiles"],
        "host_cache": result["host_cache"],
        "layer_collectives": out["programs"][0] if out["programs"] else {},
    }


def split_summary(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """This rank's check of the split (`split_on_rank`), reduced as `rank_summary`'s."""
    groups = world // args.tp
    spec = SplitSpec(
        preset=args.preset,
        overrides=_overrides(args),
        prefill_tp=args.tp,
        decode_tp=args.decode_tp,
        requests=tuple(args.tp // args.decode_tp + g % 2 for g in range(groups)),
    )
    r = split_on_rank(rank, world, spec)
    errors = [r["prefill"], *r["decode"]]
    return {
        "rank": rank,
        "node": node_id(),
        "mode": f"prefill tp={args.tp}, decode tp={args.decode_tp}",
        "steps": [{"rows": 0, "max_abs_err": e, "ok": e <= TOLERANCE["atol"]} for e in errors],
        "cache_diff": r["cache"],
        "cache_ok": r["cache"] <= TOLERANCE["atol"],
        "tokens_ok": r["tokens"] == r["greedy"],
        "programs": r["programs"],
        "host_cache": {},
        "layer_collectives": {},
    }


def _overrides(args: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
    overrides: tuple[tuple[str, Any], ...] = (("n_layers", args.layers),)
    if args.sinkhorn:
        overrides += (("hc_sinkhorn_iters", args.sinkhorn),)
    return overrides


def spec_of(args: argparse.Namespace, world: int) -> CaseSpec:
    if world % args.tp:
        sys.exit(f"--tp {args.tp} does not divide the {world} ranks launched")
    options = (("tp", args.tp), ("ep", args.ep), ("lowering", args.lowering))
    return CaseSpec(
        steps=serving_steps(world // args.tp),
        preset=args.preset,
        overrides=_overrides(args),
        options=options,
        modes=(args.mode,),
    )


def matches(summary: dict[str, Any]) -> bool:
    """Whether a rank's summary matches the single-device model: every step's logits, its
    cache and (the split) its tokens."""
    steps_ok = all(step["ok"] for step in summary["steps"])
    return steps_ok and summary["cache_ok"] and summary.get("tokens_ok", True)


def print_table(summaries: list[dict[str, Any]]) -> None:
    for s in summaries:
        cache = s["host_cache"]
        how = f"compiled {cache.get('compiled', 0)}, loaded {cache.get('loaded', 0)}"
        if not cache:
            how = f"{s.get('programs', '?')} programs"
        errors = " ".join(f"{step['max_abs_err']:.1e}" for step in s["steps"])
        verdict = "ok" if matches(s) else "DIFFERS"
        print(f"rank {s['rank']:3d}  {s['node']:>24}  {how:22}  logits {errors}  {verdict}")
    collectives = summaries[0]["layer_collectives"]
    for layer, kinds in collectives.items():
        print(f"layer {layer}: {', '.join(kinds) or 'no collective'}")


def main() -> int:
    parser = tool_parser(__doc__)
    parser.add_argument("--preset", default="tiny-swa")
    parser.add_argument("--layers", type=int, default=1, help="decoder layers of the preset")
    parser.add_argument("--sinkhorn", type=int, default=3, help="Sinkhorn iterations (0: preset's)")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--ep", type=int, default=None, help="1 or the world size (default)")
    parser.add_argument("--lowering", default="eager", choices=("eager", "inductor"))
    parser.add_argument("--mode", default="marked", choices=("marked", "unmarked", "dynamic"))
    parser.add_argument(
        "--decode-tp", type=int, help="check prefill at --tp and decode at this tp (a divisor)"
    )
    parser.add_argument("--json", type=Path, help="rank 0 writes every rank's summary here")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a collective waits")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    args.ep = world if args.ep is None else args.ep
    torch.set_num_threads(1)  # the host's cores are shared by its ranks
    spec = spec_of(args, world)
    if rank == 0:
        cfg = model_config(spec)
        print(
            f"{world} ranks: tp={args.tp}, dp={world // args.tp}, ep={args.ep}; "
            f"{args.preset}, {cfg.n_layers} layer(s), {args.lowering}, {args.mode}"
            + (f"; decode at tp={args.decode_tp}" if args.decode_tp else ""),
            flush=True,
        )
    if args.decode_tp is None:
        summary = rank_summary(rank, world, spec)
    else:
        if args.tp % args.decode_tp or args.ep != world:
            sys.exit("--decode-tp: a divisor of --tp, with ep the world size")
        summary = split_summary(rank, world, args)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, summary)
    # Every rank past the gather before any closes its connections: a rank that shut its
    # process group down while a peer was still finishing the gather once died in gloo's
    # teardown (SIGABRT: "terminate called without an active exception"), under load.
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return 0
    print_table(gathered)
    if args.json:
        args.json.write_text(json.dumps(gathered, indent=1))
    same = all(matches(s) for s in gathered)
    print("every rank matches the single-device model" if same else "some ranks differ")
    return 0 if same else 1


if __name__ == "__main__":
    run(main)
