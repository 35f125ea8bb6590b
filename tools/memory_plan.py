"""Per-rank memory of a planned layout: weight bytes (by dtype, sharded vs replicated) and the
KV cache's bytes per request and per token, read from the planned per-rank graph.

    python tools/memory_plan.py --preset flash --tp 4 --ep 8 --max-len 65536

It answers "does it fit on 8 devices of N GiB?" for the weights as the program holds them, by
dtype (`--weight-format`: "released", the default, holds the weights as the checkpoint stores
them: the routed experts' int8 FP4 codes and the FP8 linears' float8_e4m3fn codes, with their
float8_e8m0fnu scales; "dequantized" holds them in the model's dtype; the Engram tables stay
FP8 codes with e8m0 scales either way) and the cache as the model lays it out: per request, a
ring of `window` rows per layer (a fixed size) and the compressed caches' `max_len / ratio`
entries (which grow with the length). Activations are not counted; with `--lowering
npugraph_ex` (or `torchair`) the program as that lowering hands it over is planned too, and
what its MoE calls make from the expert weights per call (a decode of their FP4 codes) is
reported. A preset with DSpark stages
(`flash-dspark`) also plans the drafter's program and adds its weights and rings. The Engram
tables are counted apart, in device and in host memory, for the placement `--engram` asks
for (`all`: each placement, one plan each). Planning flash takes about a minute per plan.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from typing import Any

import torch

from dsv41_compile.core.meta import module_paths
from dsv41_compile.core.torch_private import OpOverload, op_short_name
from dsv41_compile.deepseek_v41.model import ModelConfig
from dsv41_compile.deepseek_v41.testing.batches import Request
from dsv41_compile.planning import plan_rank
from dsv41_compile.report.accounting import rank_inputs
from dsv41_compile.report.cli import run, tool_parser
from dsv41_compile.report.provenance import provenance
from dsv41_compile.testing.torchair_standin import register_npu_ops

_TABLES = re.compile(r"layers\.\d+\.engram\.embed\.(weight|scale)")
"""The Engram tables: their FP8 codes and e8m0 scales."""
_FIXED = ("cache.window_kv", "cache.pair_state")
"""The cache tensors of a fixed size per request: the window rings and the ratio-2 pair state."""


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n:.0f} B"


def plan(
    cfg: ModelConfig,
    options: dict[str, Any],
    *,
    world_size: int,
    max_len: int,
    num_slots: int,
    program: str = "backbone",
) -> tuple[Any, Any]:
    """Rank 0's planned graph and context of `program` ("backbone" or the DSpark "drafter"),
    with a cache of `num_slots` x `max_len`."""
    requests = [Request(s, [1], 0) for s in range(num_slots)]
    gm, ctx, _ = plan_rank(
        cfg, options, world_size=world_size, requests=requests, max_len=max_len, program=program,
        progress=f"planning {program} tp={options.get('tp')} {options.get('lowering', 'eager')}",
    )  # fmt: skip
    return gm, ctx


def memory_plan(gm: Any, ctx: Any, *, max_len: int, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The bytes of a planned rank's inputs: `weights[dtype][kind]` (kind "sharded" /
    "replicated"), `cache` (cache tensor -> bytes), and per request of `max_len` positions:
    `cache_per_request` (all of it), `cache_fixed_per_request` (the window rings and the
    ratio-2 pair state, whatever the length) and `cache_per_token` (the compressed caches,
    which grow with the length). Parameters named in `skip` are not counted (the drafter's
    views of the backbone's embedding and head)."""
    weights: dict[str, dict[str, int]] = defaultdict(lambda: {"sharded": 0, "replicated": 0})
    tables = {"device": 0, "host": 0}
    cache: dict[str, int] = {}
    rows = 1
    for held in rank_inputs(gm, ctx):
        if held.param is not None:
            if held.param in skip:
                continue
            if _TABLES.fullmatch(held.param):
                host = held.shard is not None and held.shard.host
                tables["host" if host else "device"] += int(held.bytes)
                continue
            kind = "sharded" if held.shard is not None else "replicated"
            weights[str(held.value.dtype).removeprefix("torch.")][kind] += int(held.bytes)
        elif held.cache:
            cache[held.source] = int(held.bytes)
            rows = held.value.shape[0]  # the requests' slots + the scratch slot
    fixed = sum(n for s, n in cache.items() if s.startswith(_FIXED)) / rows
    growing = sum(n for s, n in cache.items() if not s.startswith(_FIXED)) / rows
    return {
        "weights": {dtype: dict(kinds) for dtype, kinds in weights.items()},
        "engram_tables": {k: int(v) for k, v in tables.items()},
        "cache": cache,
        "cache_per_request": fixed + growing,
        "cache_fixed_per_request": fixed,
        "cache_per_token": growing / max_len,
    }


def decoded_per_call(gm: Any, ctx: Any) -> int:
    """The bytes a MoE layer's call of the planned program makes from the rank's expert weights
    and drops after it (the most of any layer): the values an op computes from a stacked expert
    weight (a 3-D parameter a routed-experts op or torch_npu's grouped matmul reads) other than
    a matmul's product -- a decode of FP4 codes to the activation dtype."""
    views = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand",
             "unsqueeze", "slice", "select"}  # fmt: skip
    made: dict[Any, int | None] = {}  # node -> its layer, each counted once
    matmuls = ("npu_grouped_matmul", "routed_experts", "routed_experts_fp4", "mm", "bmm",
               "npu_quant_matmul")  # fmt: skip

    def name(node: Any) -> str:
        target = node.target
        return op_short_name(target) if isinstance(target, OpOverload) else str(target)

    def feeds_experts(node: Any) -> bool:
        """Whether `node`'s value reaches a grouped matmul or a routed-experts op (through
        views and at most a decode)."""
        seen, todo = set(), list(node.users)
        while todo:
            user = todo.pop()
            if user in seen:
                continue
            seen.add(user)
            if name(user) in ("npu_grouped_matmul", "routed_experts", "routed_experts_fp4"):
                return True
            if name(user) in views or name(user) in ("npu_anti_mx_quant", "constant_pad_nd"):
                todo.extend(user.users)
        return False

    for node in gm.graph.nodes:
        if node.op != "placeholder" or node.name not in ctx.param_fqns:
            continue
        value = node.meta.get("val")
        if value is None or value.dim() != 3 or not feeds_experts(node):
            continue
        todo = list(node.users)
        while todo:
            user = todo.pop()
            if name(user) in views:
                todo.extend(user.users)
            elif name(user) not in matmuls and isinstance(user.meta.get("val"), torch.Tensor):
                made[user] = ctx.adapter.innermost_site(module_paths(user)).layer
    by_layer: dict[int | None, int] = defaultdict(int)
    for node, layer in made.items():
        by_layer[layer] += node.meta["val"].numel() * node.meta["val"].element_size()
    return max(by_layer.values(), default=0)


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("--preset", default="flash")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--layout", default="sp", choices=("sp", "replicated"))
    parser.add_argument(
        "--attn-exit", default="auto", choices=("auto", "reduce_scatter", "all_to_all"),
        help="the all-to-all exit holds wo_b whole on every rank",
    )  # fmt: skip
    parser.add_argument("--max-len", type=int, default=4096, help="positions per request")
    parser.add_argument("--slots", type=int, default=4, help="requests the cache holds")
    parser.add_argument(
        "--engram", default="auto", choices=("auto", "replicated", "sharded", "host", "all"),
        help="the Engram tables' placement (all: plan each)",
    )  # fmt: skip
    parser.add_argument(
        "--weight-format", default="released", choices=("released", "dequantized"),
        help="the weights as released (FP8 linears, FP4 routed experts; the official numerics, "
        "as ModelConfig.from_hf reads a checkpoint) or in the model's dtype",
    )  # fmt: skip
    parser.add_argument(
        "--lowering", action="append", default=[], choices=("npugraph_ex", "torchair"),
        help="also plan the program as this NPU lowering hands it over and report what its "
        "MoE calls make from the expert weights per call (repeatable)",
    )  # fmt: skip
    args = parser.parse_args()
    print(provenance(kind="Counted"), flush=True)  # the docs/benchmarks.md block's header
    overrides: dict[str, Any] = {"weight_format": args.weight_format}
    if args.weight_format == "released":  # as `from_hf` reads a checkpoint (step_time.py too)
        overrides.update(numerics="official", dtype="bfloat16")
    cfg = ModelConfig.from_name(args.preset, **overrides)
    placements = ("replicated", "sharded", "host") if args.engram == "all" else (args.engram,)
    for engram in placements:
        options = {
            "tp": args.tp, "ep": args.ep, "layout": args.layout, "attn_exit": args.attn_exit,
            "engram": engram,
        }  # fmt: skip
        _print(cfg, options, args)


def _print(cfg: ModelConfig, options: dict[str, Any], args: argparse.Namespace) -> None:
    gm, ctx = plan(cfg, options, world_size=args.world, max_len=args.max_len, num_slots=args.slots)
    report = memory_plan(gm, ctx, max_len=args.max_len)
    print(f"{args.preset} ({cfg.weight_format}), {options}, world {args.world}: rank 0 holds")
    total = 0
    for dtype, kinds in sorted(report["weights"].items()):
        for kind, size in kinds.items():
            total += size
            print(f"  weights {dtype:<9} {kind:<10} {_size(size):>12}")
    print(f"  weights total                {_size(total):>12}")
    tables = report["engram_tables"]
    why = next((w for k, w in ctx.choices.items() if "engram" in k), "no Engram tables")
    print(f"  Engram tables on the device  {_size(tables['device']):>12}")
    print(f"  Engram tables in host memory {_size(tables['host']):>12}   ({why})")
    for lowering in args.lowering:  # the MoE's transient, read from the lowered program
        register_npu_ops()  # torch_npu's ops the NPU lowerings emit, on CPU
        lowered, lowered_ctx = plan(
            cfg, {**options, "lowering": lowering}, world_size=args.world,
            max_len=args.max_len, num_slots=args.slots,
        )  # fmt: skip
        made = decoded_per_call(lowered, lowered_ctx)
        print(
            f"  transient with lowering={lowering!r}: made from the expert weights per MoE "
            f"call {_size(made):>12}"
        )
    print(
        f"  KV cache: {_size(report['cache_per_request'])} per request of {args.max_len} "
        f"positions: {_size(report['cache_fixed_per_request'])} of window rings and pair state, "
        f"and {_size(report['cache_per_token'])} per token of compressed entries"
    )
    if cfg.num_nextn_predict_layers:  # the drafter's program: its own weights and rings
        gm, ctx = plan(
            cfg, options, world_size=args.world, max_len=args.max_len, num_slots=args.slots,
            program="drafter",
        )  # fmt: skip
        drafter = memory_plan(gm, ctx, max_len=args.max_len, skip=("embed.weight", "head.weight"))
        weights = sum(sum(kinds.values()) for kinds in drafter["weights"].values())
        by_dtype = ", ".join(
            f"{dtype} {_size(sum(kinds.values()))}"
            for dtype, kinds in sorted(drafter["weights"].items())
        )
        rings = sum(drafter["cache"].values()) / (args.slots + 1)
        heads = _eager_heads(cfg)
        print(
            f"  DSpark drafter ({cfg.num_nextn_predict_layers} stages; the embedding and head are "
            f"the backbone's): weights {_size(weights)} ({by_dtype}); its rings "
            f"{_size(rings)} per request"
        )
        print(
            f"  DSpark heads run eagerly by serving (Markov, confidence), whole on every rank: "
            f"{_size(heads)}"
        )
        print(f"  weights total with the drafter {_size(total + weights + heads):>10}")


def _eager_heads(cfg: ModelConfig) -> int:
    """Bytes of the drafter's heads that no compiled program holds: `serving.propose` runs the
    Markov head eagerly, and nothing runs the confidence head; each rank holds both whole."""
    from dsv41_compile.deepseek_v41.model import DeepseekV41

    with torch.device("meta"):
        mtp = DeepseekV41(cfg).mtp
    heads = [*mtp.markov_head.parameters(), *mtp.confidence_head.parameters()]
    return sum(p.numel() * p.element_size() for p in heads)


if __name__ == "__main__":
    run(main)
