"""Per-rank comparison of the dsv41_sp-compiled model against the single-device model, for the
multi-rank tests and the demo.

Every rank builds the same model (same seed), serves its DP group's batches with the compiled
model and, on the same inputs, with the plain model; it returns both logits of every step and,
optionally, the values entering chosen modules on both sides (`testing.capture`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._dynamo

from dsv41_compile.backend import mark_token_dim
from dsv41_compile.core.hooks import Hooks, installed
from dsv41_compile.model import DeepseekV41, ModelConfig
from dsv41_compile.testing.batches import Request, pack
from dsv41_compile.testing.capture import capture_compiled, capture_reference

__all__ = ["SERVING_STEPS", "SERVING_STEP_NAMES", "CaseSpec", "compare_on_rank", "model_config"]

Step = tuple[tuple[Request, ...], ...]
"""One step: the requests of each DP group (index = dp rank)."""

# Two DP groups through the cache: (group 0 requests, group 1 requests) per step.
SERVING_STEPS: tuple[Step, ...] = (
    # The requirement's example: requests of 3, 2, 3 tokens in both groups, other tokens.
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
)
SERVING_STEP_NAMES = ("prefill", "decode", "multi-token decode", "prefill + decode")


@dataclass(frozen=True)
class CaseSpec:
    steps: tuple[Step, ...]
    preset: str = "tiny-swa"
    overrides: tuple[tuple[str, Any], ...] = ()
    options: tuple[tuple[str, Any], ...] = (("tp", 4),)
    capture: tuple[str, ...] = ()
    num_slots: int = 4
    max_len: int = 32
    dump: bool = False
    """Compile with a temporary `dump_dir` and return this rank's `comm.json` (with the EP
    traffic of every call in `ep_steps`)."""
    torchair_standin: bool = False
    """With `lowering="torchair"`: torchair replaced by `testing.torchair_standin` (its AOT
    step, then the graph run eagerly), so the graph torchair would get runs on CPU."""


def model_config(spec: CaseSpec) -> ModelConfig:
    return ModelConfig.from_name(spec.preset, **dict(spec.overrides))


def compare_on_rank(rank: int, world_size: int, spec: CaseSpec) -> dict[str, Any]:
    """Run every step of `spec` on this rank, compiled and single-device. Returns
    `{"steps": [{"T", "sp", "ref"}], "captures": {module: (sp values, ref values)},
    "frames": graphs compiled, "cache_diff": max |sp cache - ref cache|, "comm": comm.json or
    None, "torchair_ops": with the torchair stand-in, the ops of the graphs after torchair's AOT
    step (name -> count), else None}`."""
    import dsv41_compile  # noqa: F401  (registers the backend in the spawned process)

    options = dict(spec.options)
    tp = options.get("tp", 1)
    standin = None
    stack = contextlib.ExitStack()
    if spec.torchair_standin:
        from dsv41_compile.testing.torchair_standin import TorchairStandIn

        standin = TorchairStandIn()
        stack.enter_context(installed(Hooks(torchair=standin)))
    dump_dir = tempfile.mkdtemp(prefix="dsv41_dump_") if spec.dump else None
    if dump_dir is not None:
        options["dump_dir"] = dump_dir
    dp_rank = rank // tp
    torch.manual_seed(0)
    model = DeepseekV41(model_config(spec))
    reference = copy.deepcopy(model)  # its own module objects: hooks never reach the compiled one
    sp_cache = model.new_cache(spec.num_slots, spec.max_len)
    ref_cache = reference.new_cache(spec.num_slots, spec.max_len)
    torch._dynamo.reset()
    frames = 0

    def counting(gm: Any, example_inputs: Any) -> Any:
        nonlocal frames
        frames += 1
        return dsv41_compile.dsv41_sp(gm, example_inputs, options=options)

    compiled = torch.compile(model, backend=counting, fullgraph=True)
    steps = []
    with (
        stack,
        capture_compiled(spec.capture) as sp_store,
        capture_reference(reference, spec.capture) as ref_store,
    ):
        for step in spec.steps:
            ids, positions, slots = pack(step[dp_rank])
            mark_token_dim(ids, positions, slots)
            sp = compiled(ids, positions, slots, sp_cache)
            ref = reference(ids, positions, slots, ref_cache)
            steps.append({"T": int(ids.numel()), "sp": sp, "ref": ref})
    captures = {m: (sp_store[m], ref_store[m]) for m in spec.capture}
    cache_diff = max(
        float((a.double() - b.double()).abs().max())
        for a, b in zip(sp_cache.tensors(), ref_cache.tensors())
    )
    comm = None
    if dump_dir is not None:
        comm = json.loads((Path(dump_dir) / f"rank{rank}" / "comm.json").read_text())
        shutil.rmtree(dump_dir)
    torchair_ops = None
    if standin is not None:  # what torchair's converters would see, op name -> count
        from dsv41_compile.testing.torchair_standin import graph_ops

        torchair_ops = sum((graph_ops(gm) for gm in standin.aot_graphs), Counter())
    return {
        "steps": steps,
        "captures": captures,
        "frames": frames,
        "cache_diff": cache_diff,
        "comm": comm,
        "torchair_ops": torchair_ops,
    }
