"""Synthetic checkpoints in the released format, for tests, the demo and the tools.

    model = synthetic_checkpoint(cfg, out_dir, seed=1)   # the seeded model that was written

`out_dir` gets `config.json` (`hf_config.config_to_hf`), `model.safetensors.index.json` and
`files` shards (`checkpoint.write_checkpoint`: FP8 / FP4 with their scales under the released
names); `ModelConfig.from_hf(out_dir)` and `load_checkpoint(model, out_dir)` read it back.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.tensor import Shard

from dsv41_compile.core.adapter import WeightInput, WeightRange, WeightSlice
from dsv41_compile.core.placements import ColumnShard, ExpertShard
from dsv41_compile.deepseek_v41.adapter import DEEPSEEK_V41
from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig
from dsv41_compile.deepseek_v41.model.checkpoint import (
    checkpoint_layout,
    read_weights,
    write_checkpoint,
)
from dsv41_compile.deepseek_v41.model.engram import EngramTable
from dsv41_compile.deepseek_v41.model.hf_config import config_to_hf
from dsv41_compile.families import options_for
from dsv41_compile.options import BackendOptions

__all__ = ["loading_peak", "rank_weight_inputs", "synthetic_checkpoint"]


def synthetic_checkpoint(
    cfg: ModelConfig, out: str | Path, *, seed: int = 0, files: int = 3
) -> DeepseekV41:
    """The model `cfg` describes, built with seed `seed`, written to `out` (created) as a
    checkpoint of `files` shards with its config; returns the model."""
    out = Path(out)
    torch.manual_seed(seed)
    model = DeepseekV41(cfg)
    write_checkpoint(model, out, files=files)
    (out / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2))
    return model


def rank_weight_inputs(cfg: ModelConfig, options: dict[str, Any], rank: int) -> list[WeightInput]:
    """What rank `rank` holds of each parameter under `options` (the plan's placements): the
    slices the backend's `checkpoint` option reads for it."""
    model = DeepseekV41.without_weights(cfg)
    given = options_for(BackendOptions.from_dict(options), DEEPSEEK_V41)
    opts, _ = DEEPSEEK_V41.resolve(given, dict(model.named_parameters()))
    plan = DEEPSEEK_V41.plan(opts)
    inputs = []
    part: WeightSlice | WeightRange | None
    for fqn, p in model.named_parameters():
        placement, part = plan.param_placement(fqn), None
        if isinstance(placement, ExpertShard):
            part = WeightSlice(placement.dim, rank, opts.ep)
        elif isinstance(placement, ColumnShard):  # the rows of this rank's columns
            bounds = cast(EngramTable, model.get_submodule(fqn.rpartition(".")[0])).columns
            k = -(-(len(bounds) - 1) // opts.ep)
            first, last = (min(r * k, len(bounds) - 1) for r in (rank, rank + 1))
            part = WeightRange(0, bounds[first], bounds[last])
        elif isinstance(placement, Shard):
            part = WeightSlice(placement.dim, rank % opts.tp, opts.tp)
        inputs.append(WeightInput(fqn, tuple(p.shape), p.dtype, part))
    return inputs


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def loading_peak(path: str | Path, weights: list[WeightInput]) -> dict[str, int]:
    """`read_weights(path, weights)` with this process's anonymous memory sampled every 0.2 ms:
    the peak above what it held before (`peak`), the bytes of the tensors returned (`own`)
    and of the largest whole parameter part one checkpoint tensor decodes to (`largest`).
    Linux only (/proc/self/status); a sample can miss a peak shorter than its interval."""
    import safetensors  # noqa: F401  (its extension loaded before the baseline)

    start, peak, done = _rss_anon(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_anon())
            time.sleep(2e-4)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        local, _ = read_weights(path, weights)
        peak[0] = max(peak[0], _rss_anon())
    finally:
        done.set()
        sampler.join()
    by_fqn = {w.fqn: w for w in weights}
    largest = max(
        math.prod(by_fqn[e.param].shape[e.expert is not None :])  # an expert: one row of it
        * torch.empty((), dtype=by_fqn[e.param].dtype).element_size()
        for e in checkpoint_layout({w.fqn: w.shape for w in weights}).values()
    )
    own = sum(t.numel() * t.element_size() for t in local)
    return {"peak": peak[0] - start, "own": own, "largest": largest}
