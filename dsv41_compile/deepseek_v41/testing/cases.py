"""Per-rank comparison of the dsv41_sp-compiled model against the single-device model, for the
multi-rank tests and the demo.

Every rank builds the same model (same seed), serves its DP group's batches with the compiled
model (each batch checked against the compiled model's cache by `validate_batch` first) and,
on the same inputs, with the plain model; it returns both logits of every step,
the collectives of every program it compiled and, optionally, the values entering chosen
modules on both sides (`testing.observe`).

A case runs in one or more compile modes on every rank, or one mode per DP group, each a fresh
`torch.compile` of the model with its own cache, the way a user calls it:

- "marked": `mark_token_dim` before each call (one graph for every T);
- "unmarked": plain `torch.compile(model, backend="dsv41_sp", options=...)` -- Dynamo traces the
  first T statically, then with a dynamic T, and T = 0 / 1 statically;
- "dynamic": `torch.compile(..., dynamic=True)`;
- "static": `torch.compile(..., dynamic=False)`: a static graph per T.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsv41_compile.core.hooks import Hooks, installed
from dsv41_compile.core.torch_private import dynamo_config
from dsv41_compile.core.torch_private import dynamo_counters as counters
from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig, load_checkpoint
from dsv41_compile.deepseek_v41.model.validate import validate_batch
from dsv41_compile.deepseek_v41.testing.batches import Request, pack
from dsv41_compile.deepseek_v41.testing.edits import EDITS
from dsv41_compile.frontend.tokens import mark_token_dim
from dsv41_compile.runtime import weights
from dsv41_compile.runtime.host_cache import STATS
from dsv41_compile.testing.fake_rank import layer_collectives
from dsv41_compile.testing.observe import capture_compiled, capture_reference
from dsv41_compile.testing.selections import watch_selections

__all__ = [
    "MODES",
    "SERVING_STEPS",
    "SERVING_STEP_NAMES",
    "CaseSpec",
    "serving_steps",
    "compare_on_rank",
    "model_config",
]

Step = tuple[tuple[Request, ...], ...]
"""One step: the requests of each DP group (index = dp rank); () is an idle group (T = 0)."""

# Two DP groups through the cache: (group 0 requests, group 1 requests) per step.
SERVING_STEPS: tuple[Step, ...] = (
    # The seed's example: requests of 3, 2, 3 tokens in both groups, other tokens.
    (
        (Request(0, [1, 2, 3], 0), Request(1, [4, 5], 0), Request(2, [6, 7, 8], 0)),
        (Request(0, [9, 10, 11], 0), Request(1, [12, 13], 0), Request(2, [14, 15, 16], 0)),
    ),
    # Decode: T = 3 < tp (an empty shard) in group 0, T = 1 in group 1 (different T per group).
    ((Request(0, [17], 3), Request(1, [18], 2), Request(2, [19], 3)), (Request(1, [20], 2),)),
    # Multi-token decode (DSpark verification): T = 5 and 6, neither divisible by tp = 4.
    (
        (Request(0, [21, 22], 4), Request(1, [23, 24], 3), Request(2, [25], 4)),
        (Request(0, [26, 27, 28], 3), Request(1, [29, 30, 31], 3)),
    ),
    # A longer prefill next to decodes: compressed entries beyond the indexer's top-k; two
    # padding rows (slot -1) in group 0.
    (
        (Request(3, list(range(40, 53)), 0), Request(-1, [0, 0], 0), Request(0, [32], 6)),
        (Request(3, list(range(60, 80)), 0), Request(2, [33], 3)),
    ),
    # An idle DP group: group 0 has no token (T = 0) while group 1 decodes; its ranks still
    # take part in the EP all-to-alls.
    (
        (),
        (Request(0, [34], 6), Request(1, [35], 6), Request(2, [36], 4), Request(3, [37], 20)),
    ),
)
SERVING_STEP_NAMES = ("prefill", "decode", "multi-token decode", "prefill + decode", "idle group")
MODES = ("marked", "unmarked", "dynamic", "static")


def serving_steps(dp: int) -> tuple[Step, ...]:
    """Three steps through the cache for `dp` DP groups, each group with its own tokens: a
    prefill of 5 to 8 tokens (group g: requests of 3 + g % 4 and 2 tokens), a decode of one
    to three requests (1 + g % 3: a T below tp = 4 leaves a rank without a token), then group 0
    idle (T = 0) while the others decode one token of request 0."""

    def ids(g: int, step: int, n: int) -> list[int]:
        return [(97 * g + 31 * step + 7 * i) % 500 + 1 for i in range(n)]

    lengths = [(3 + g % 4, 2) for g in range(dp)]
    prefill = tuple(
        (Request(0, ids(g, 0, a), 0), Request(1, ids(g, 1, b), 0))
        for g, (a, b) in enumerate(lengths)
    )
    decode = tuple(
        tuple(
            Request(slot, ids(g, 2 + slot, 1), lengths[g][slot] if slot < 2 else 0)
            for slot in range(1 + g % 3)
        )
        for g in range(dp)
    )
    held = [(a + 1, b + (g % 3 >= 1)) for g, (a, b) in enumerate(lengths)]
    idle = ((),) + tuple((Request(0, ids(g, 5, 1), held[g][0]),) for g in range(1, dp))
    return (prefill, decode, idle)


@dataclass(frozen=True)
class CaseSpec:
    steps: tuple[Step, ...]
    preset: str = "tiny-swa"
    overrides: tuple[tuple[str, Any], ...] = ()
    options: tuple[tuple[str, Any], ...] = (("tp", 4),)
    modes: tuple[str, ...] = ("marked",)
    """Compile modes (`MODES`), each a fresh compile of the model with its own cache."""
    group_modes: tuple[str, ...] = ()
    """If set, one compile mode per DP group (index = dp rank) instead of `modes` on every
    rank: the groups' programs differ, their collectives do not."""
    capture: tuple[str, ...] = ()
    """Modules whose entering values are captured on both sides (first mode only)."""
    num_slots: int = 4
    max_len: int = 32
    dump: bool = False
    """Compile with a temporary `dump_dir` and return this rank's `comm.json` (with the EP
    traffic of every call in `ep_steps`), first mode only."""
    npu_standin: bool = False
    """With `lowering="torchair"` or `"npugraph_ex"`: torch_npu's backend replaced by its
    stand-in (`testing.torchair_standin`, `testing.npugraph_ex_standin`: its AOT step, then the
    graph run eagerly), so the graph the backend would get runs on CPU."""
    checkpoint: str | None = None
    """A checkpoint directory in the released format (tools/make_checkpoint.py). The compiled
    side is `DeepseekV41.without_weights` compiled with the `checkpoint` option (each rank
    reads its own slices); the single-device side is loaded from it whole (`load_checkpoint`)."""
    logit_rows: bool = False
    """Ask the compiled model for the rows a serving loop reads (`logit_rows`): each request's
    last row, and every row of a request continuing its cache (a decode, a verify); the
    reference's logits are then the whole batch's, those rows taken."""
    edits: tuple[tuple[str, tuple[int, ...] | None], ...] = ()
    """Edits of the model's source (`deepseek_v41.testing.edits.EDITS`), each with the decoder layers it is
    made in (None: every layer, or the modules around them), made on both sides: the compiled
    model and the single-device reference are the same edited model."""


def model_config(spec: CaseSpec) -> ModelConfig:
    return ModelConfig.from_name(spec.preset, **dict(spec.overrides))


def compare_on_rank(rank: int, world_size: int, spec: CaseSpec) -> dict[str, Any]:
    """Run every step of `spec` on this rank, compiled (in each mode) and single-device.

    Returns `{"T": tokens per step, "R": logit rows per step (T unless `spec.logit_rows`),
    "ref": reference logits per step (of those rows), "cache": reference cache
    tensors, "modes": {mode: {"logits": per step, "programs": [collectives per layer of each
    program compiled], "outside_layers": [the sorted collectives of each program outside its
    layers], "compiles": programs compiled, "cache_diff": max |cache - ref cache|}},
    "captures": {module: (compiled values, ref values)}, "near_ties": the single-device
    model's selections by value whose scores tied within rounding, by step
    (`testing.selections`: where the compiled model may rightly select other rows), "comm":
    comm.json or None,
    "npu_ops": with an NPU backend's stand-in, the ops after the backend's AOT step (name ->
    count), "npu_fp4_ops": of those, the ones that take or decode FP4 values, "npu_calls": with
    npugraph_ex's, how it ran each call (captured, replayed, uncaptured), "host_cache": this process's shared compiles (`runtime.host_cache.STATS`),
    "inductor": inductor's FX graph cache hits and misses in this process, "checkpoint_read":
    the bytes the compiled side read per checkpoint tensor in this case, "reference_read": the
    bytes the single-device side read}`."""
    options = dict(spec.options)
    dp_rank = rank // options.get("tp", 1)
    torch.manual_seed(0)
    cfg = model_config(spec)
    read_before = dict(weights.READ)  # a pool's rank process serves several cases
    if spec.checkpoint is None:
        model = DeepseekV41(cfg)
        for name, layers in spec.edits:
            EDITS[name].apply(model, layers)
        reference = copy.deepcopy(model)  # its own modules: hooks never reach the compiled one
        reference_read = {}
    else:
        model = DeepseekV41.without_weights(cfg)
        options["checkpoint"] = spec.checkpoint
        reference = DeepseekV41.without_weights(cfg)
        reference_read = load_checkpoint(reference, spec.checkpoint)
    batches = [pack(step[dp_rank]) for step in spec.steps]
    rows = [_served_rows(step[dp_rank]) if spec.logit_rows else None for step in spec.steps]
    ref_cache = reference.new_cache(spec.num_slots, spec.max_len)
    out: dict[str, Any] = {"T": [int(b[0].numel()) for b in batches], "modes": {}}
    out["R"] = [t if r is None else len(r) for t, r in zip(out["T"], rows)]
    out["reference_read"] = reference_read
    out["near_ties"] = []
    with capture_reference(reference, spec.capture) as ref_store:
        out["ref"] = []
        for step, (batch, r) in enumerate(zip(batches, rows)):
            with watch_selections() as ties:
                ref = reference(*batch, ref_cache)
            out["ref"].append(ref if r is None else ref[r])
            out["near_ties"] += [f"step {step}: {tie}" for tie in ties]
    standin: Any = None
    stack = contextlib.ExitStack()
    if spec.npu_standin and options.get("lowering") == "npugraph_ex":
        from dsv41_compile.testing.npugraph_ex_standin import NpugraphExStandIn

        standin = NpugraphExStandIn()
        stack.enter_context(installed(Hooks(npugraph_ex=standin)))
    elif spec.npu_standin:
        from dsv41_compile.testing.torchair_standin import TorchairStandIn

        standin = TorchairStandIn()
        stack.enter_context(installed(Hooks(torchair=standin)))
    dump_dir = tempfile.mkdtemp(prefix="dsv41_dump_") if spec.dump else None
    with stack:
        modes = (spec.group_modes[dp_rank],) if spec.group_modes else spec.modes
        for i, mode in enumerate(modes):
            first = i == 0
            mode_options = dict(options)
            if first and dump_dir is not None:
                mode_options["dump_dir"] = dump_dir
            with capture_compiled(spec.capture if first else ()) as store:
                out["modes"][mode] = _run_mode(model, mode, mode_options, batches, rows, spec)
            if first:
                out["captures"] = {m: (store[m], ref_store[m]) for m in spec.capture}
        for result in out["modes"].values():
            result["cache_diff"] = max(
                float((a.double() - b.double()).abs().max())
                for a, b in zip(result.pop("cache").tensors(), ref_cache.tensors())
            )
    out["comm"] = None
    if dump_dir is not None:
        out["comm"] = json.loads((Path(dump_dir) / f"rank{rank}" / "comm.json").read_text())
        shutil.rmtree(dump_dir)
    out["npu_ops"] = out["npu_fp4_ops"] = out["npu_calls"] = None
    if standin is not None:  # what the backend's own passes would see, op name -> count
        from dsv41_compile.testing.torchair_standin import fp4_ops, graph_ops

        out["npu_ops"] = sum((graph_ops(gm) for gm in standin.aot_graphs), Counter())
        out["npu_fp4_ops"] = sum((fp4_ops(gm) for gm in standin.aot_graphs), Counter())
        out["npu_calls"] = getattr(standin, "calls", None)
    out["checkpoint_read"] = {
        name: n - read_before.get(name, 0)
        for name, n in weights.READ.items()
        if n != read_before.get(name, 0)
    }
    out["host_cache"] = dict(STATS)
    out["inductor"] = {k: v for k, v in counters["inductor"].items() if "fxgraph" in k}
    return out


def _served_rows(requests: tuple[Request, ...]) -> torch.Tensor:
    """The rows a serving loop reads of a packed batch of `requests`: each request's last row,
    and all of a request's rows when it continues its cache."""
    rows: list[int] = []
    start = 0
    for r in requests:
        stop = start + len(r.ids)
        rows += range(start if r.start > 0 else stop - 1, stop)
        start = stop
    return torch.tensor(rows, dtype=torch.int64)


def _run_mode(
    model: DeepseekV41,
    mode: str,
    options: dict[str, Any],
    batches: list,
    rows: list[torch.Tensor | None],
    spec: CaseSpec,
) -> dict[str, Any]:
    if mode not in MODES:
        raise ValueError(f"unknown compile mode {mode!r}; the modes are {MODES}")
    start = time.perf_counter()
    torch.compiler.reset()  # each mode compiles afresh (and Dynamo's recompile limit is per mode)
    settings = dict(kv for name, _ in spec.edits for kv in EDITS[name].dynamo_config)
    dynamic = {"dynamic": True, "static": False}.get(mode)
    compiled = torch.compile(model, backend="dsv41_sp", options=options, dynamic=dynamic)
    cache = model.new_cache(spec.num_slots, spec.max_len)
    programs: list[Any] = []
    logits = []
    with installed(Hooks(on_program=programs.append)), dynamo_config(**settings):
        for (ids, positions, slots), asked in zip(batches, rows):
            ids, positions, slots = ids.clone(), positions.clone(), slots.clone()
            validate_batch(
                ids, positions, slots, cache, vocab_size=model.cfg.vocab_size, logit_rows=asked
            )
            if mode == "marked":
                mark_token_dim(ids, positions, slots)
            if asked is None:
                logits.append(compiled(ids, positions, slots, cache))
            else:
                logits.append(compiled(ids, positions, slots, cache, logit_rows=asked.clone()))
    return {
        "logits": logits,
        "seconds": time.perf_counter() - start,
        "programs": [layer_collectives(p.spec.comm) for p in programs],
        "outside_layers": [
            sorted(f"{r['kind']}({r['axis']})" for r in p.spec.comm if r["layer"] is None)
            for p in programs
        ],
        "compiles": len(programs),
        "cache": cache,
    }
