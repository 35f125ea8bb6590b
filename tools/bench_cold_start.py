"""Cold and warm start of tiny on 8 CPU ranks: the compile a host pays, with and without sharing.

8 gloo processes on this host (tp=4, dp=2, ep=8) call `torch.compile(model, backend="dsv41_sp",
options=...)` the way a user does (no `mark_token_dim`) and time their first call: Dynamo, AOT,
our passes, the lowering and the step itself. Four runs, side by side in one invocation:

- `share_compile=False` ("before"): every rank compiles its own per-rank program; inductor's
  compiles are serialised by a host lock, so a rank whose graph equals an earlier one's hits
  inductor's FX graph cache instead of racing it;
- `share_compile=True` ("after", the default): one rank per host compiles each per-rank program
  and saves it, the others load it (`docs/backend.md`, "Ranks on one host");

each first with an empty cache directory (cold: a fresh `TORCHINDUCTOR_CACHE_DIR`), then again
in new processes on the cache the cold run left (warm). Reported per run: the slowest rank's
first call, the inductor compiles on the host (FX graph cache misses, summed over ranks), its
cache hits, and how many ranks compiled or loaded a shared program. Dynamo keeps no cache on
disk, so a warm start still traces the model on every rank.

    .venv/bin/python tools/bench_cold_start.py                 # inductor (default)
    .venv/bin/python tools/bench_cold_start.py --lowering eager
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

from dsv41_compile.report.cli import run, tool_parser

WORLD, TP, EP = 8, 4, 8


def first_call(rank: int, world_size: int, options: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig
    from dsv41_compile.deepseek_v41.model.validate import validate_batch
    from dsv41_compile.deepseek_v41.testing.batches import pack
    from dsv41_compile.deepseek_v41.testing.cases import SERVING_STEPS
    from dsv41_compile.runtime.host_cache import STATS

    torch.manual_seed(0)
    model = DeepseekV41(ModelConfig.from_name("tiny"))
    cache = model.new_cache(4, 32)
    ids, positions, slots = pack(SERVING_STEPS[0][rank // TP])
    validate_batch(ids, positions, slots, cache, vocab_size=model.cfg.vocab_size)
    compiled = torch.compile(model, backend="dsv41_sp", options=options)
    dist.barrier()
    start = time.perf_counter()
    compiled(ids, positions, slots, cache)
    seconds = time.perf_counter() - start
    inductor = counters["inductor"]
    return {
        "seconds": seconds,
        "misses": inductor["fxgraph_cache_miss"],
        "hits": inductor["fxgraph_cache_hit"],
        "compiled": STATS["compiled"],
        "loaded": STATS["loaded"],
    }


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("--lowering", choices=("eager", "inductor"), default="inductor")
    args = parser.parse_args()
    from dsv41_compile.report.provenance import provenance

    print(provenance(), flush=True)  # the docs/benchmarks.md block's header

    from dsv41_compile.testing.multirank import run_ranks

    print(
        f"tiny on {WORLD} CPU ranks (tp={TP}, ep={EP}), lowering={args.lowering}: "
        "compile + first call of the slowest rank"
    )
    header = (
        f"{'share_compile':<14} {'start':<5} {'first call s':>12} {'inductor compiles':>17} "
        f"{'cache hits':>10} {'programs compiled / loaded':>27}"
    )
    print(header)
    for share in (False, True):
        cache_dir = tempfile.mkdtemp(prefix="dsv41_bench_cache_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # inherited by the spawned ranks
        options = {"tp": TP, "ep": EP, "lowering": args.lowering, "share_compile": share}
        try:
            for start in ("cold", "warm"):
                ranks = run_ranks(first_call, WORLD, options)
                slowest = max(r["seconds"] for r in ranks)
                misses = sum(r["misses"] for r in ranks)
                hits = sum(r["hits"] for r in ranks)
                programs = (
                    f"{sum(r['compiled'] for r in ranks)} / {sum(r['loaded'] for r in ranks)}"
                )
                print(
                    f"{share!s:<14} {start:<5} {slowest:>12.1f} {misses:>17} {hits:>10} "
                    f"{programs:>27}",
                    flush=True,
                )
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)


if __name__ == "__main__":
    run(main)
