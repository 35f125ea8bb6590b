"""Prefill in one layout, decode in another, on every rank of a gloo world: the per-rank check of
tests/distributed/test_split.py.

Each rank compiles the same model twice (`tp=prefill_tp` and `tp=decode_tp`, the experts over
the world), prefills its DP group's requests in the first layout, hands its decode group's
share of them over to a cache of their own (`serving.hand_over`, `serving.Split.share`) and
decodes them in the second, teacher-forced, against the single-device model on the same
tokens; then `serving.generate(..., split=...)` on the same prompts, against plain greedy
decoding by the single-device model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from dsv41_compile.core.torch_private import mark_unbacked
from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig
from dsv41_compile.deepseek_v41.model.batches import Request, pack
from dsv41_compile.deepseek_v41.serving import Split, generate, hand_over
from dsv41_compile.frontend.tokens import mark_token_dim
from dsv41_compile.runtime.host_cache import STATS

__all__ = ["SplitSpec", "split_on_rank"]


@dataclass(frozen=True)
class SplitSpec:
    preset: str = "tiny-swa"
    overrides: tuple[tuple[str, Any], ...] = ()
    prefill_tp: int = 4
    decode_tp: int = 1
    requests: tuple[int, ...] = (4, 3)
    """Per prefill DP group (each group its own prompts): with fewer requests than decode
    groups, a decode group has none and joins each decode step with no token."""
    decode_steps: int = 2
    max_new_tokens: int = 4
    max_len: int = 32


def prompts_of(group: int, requests: int) -> list[list[int]]:
    """Prefill DP group `group`'s prompts: 3, 4, 5, ... tokens, ids its own."""
    return [
        [(53 * group + 17 * i + 5 * j) % 500 + 1 for j in range(3 + i)] for i in range(requests)
    ]


def split_on_rank(rank: int, world: int, spec: SplitSpec) -> dict[str, Any]:
    """Returns `{"mine": the requests this rank decodes, "prefill": max |logit diff| of the
    prefill, "cache": max |diff| of the handed-over cache against the single-device cache's
    rows, "decode": max |logit diff| per decode step, "tokens": generate's tokens (every
    request of the group), "greedy": the single-device model's greedy tokens, "programs": the
    programs this process compiled or loaded (`generate` runs those of the calls before it)}`."""
    torch.manual_seed(0)
    model = DeepseekV41(ModelConfig.from_name(spec.preset, **dict(spec.overrides)))
    reference = copy.deepcopy(model)
    common: dict[str, Any] = {"ep": world, "lowering": "eager"}
    prefill = torch.compile(model, backend="dsv41_sp", options={**common, "tp": spec.prefill_tp})
    decode = torch.compile(model, backend="dsv41_sp", options={**common, "tp": spec.decode_tp})
    split = Split(decode, spec.prefill_tp, spec.decode_tp)
    group = rank // spec.prefill_tp
    n = spec.requests[group]
    prompts = prompts_of(group, n)
    mine = split.share(rank, n)
    out: dict[str, Any] = {"mine": mine, "decode": []}

    def marked(batch: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The call's arguments as `generate` passes them (every row asked for), so that its
        calls below run the programs these calls compile."""
        ids, positions, slots = (t.clone() for t in batch)
        mark_token_dim(ids, positions, slots)
        rows = torch.arange(ids.shape[0])
        mark_unbacked(rows, 0)
        return (ids, positions, slots), rows

    with torch.no_grad():
        cache = model.new_cache(n, spec.max_len)
        ref_cache = reference.new_cache(n, spec.max_len)
        batch = pack([Request(i, p, 0) for i, p in enumerate(prompts)])
        args, rows = marked(batch)
        got, want = prefill(*args, cache, logit_rows=rows), reference(*batch, ref_cache)
        out["prefill"] = float((got - want).abs().max())
        own = model.new_cache(max(1, len(mine)), spec.max_len)
        hand_over(cache, mine, own)
        out["cache"] = max(
            float((a[: len(mine)].double() - b[mine].double()).abs().max()) if mine else 0.0
            for a, b in zip(own.tensors(), ref_cache.tensors())
        )
        held = [len(p) for p in prompts]
        for step in range(spec.decode_steps):
            token = [(31 * group + 7 * i + step) % 500 + 1 for i in range(n)]
            every = pack([Request(i, [token[i]], held[i]) for i in range(n)])
            want = reference(*every, ref_cache)[mine]
            own_batch = pack([Request(j, [token[i]], held[i]) for j, i in enumerate(mine)])
            args, rows = marked(own_batch)
            got = decode(*args, own, logit_rows=rows)
            out["decode"].append(float((got - want).abs().max()) if mine else 0.0)
            held = [h + 1 for h in held]
        out["tokens"] = generate(
            model, prompts, spec.max_new_tokens, speculative=False, backbone=prefill,
            max_len=spec.max_len, split=split,
        ).tokens  # fmt: skip
        out["greedy"] = generate(
            reference, prompts, spec.max_new_tokens, speculative=False, max_len=spec.max_len
        ).tokens
    out["programs"] = sum(STATS.values())  # compiled or loaded by this process
    return out
