"""Decoding: `generate` runs requests from their prompts to `max_new_tokens` each, plainly (one
backbone call per token) or speculatively with the DSpark drafter (`model.dspark`).

A speculative step, for every unfinished request at once (one packed call each):

1. **verify**: the backbone takes the request's pending tokens (the next token, and a token
   the cache was cut before, if any) and the drafter's proposals after them, and returns
   the logits of the rows the step reads (`logit_rows`: the one before each proposal and the
   one after the last) and what the drafter reads (`hidden=True`);
2. **accept**: greedy (temperature 0) keeps the proposals while each equals the argmax of
   the logits before it, then takes that argmax: the tokens are exactly those of plain greedy
   decoding. Sampling (temperature > 0) keeps proposal d with probability `min(1, p(d) /
   q(d))` and on the first rejection samples from `max(p - q, 0)` renormalised (p the
   backbone's distribution, q the drafter's): each token is distributed as the backbone
   samples it. When every proposal is kept, one more token comes from the last row's logits;
3. **cut**: the backbone's cache is cut back to the kept positions (`DeepseekV41.cut_cache`:
   the rows the rejected positions wrote are put back, so the cache is that of a run that
   never saw them). With a ratio-2 compressor the cut is even (`cache_cut`), and a kept token
   it drops is fed again with the next verify;
4. **draft**: the drafter takes the backbone's captures of the newly kept positions (its
   cache only ever holds kept positions) and a block `[next token, noise, ...]`, and each
   proposal is sampled in order with the Markov bias of the one before.

`generate` drives eager modules or compiled ones (`backbone=`, `drafter=`: the programs
`torch.compile` returns, run on every rank alike); the cache rollback and the Markov chain
run eagerly on `model` itself (every rank holds the same caches).

Prefill and decode in different layouts (`split=Split(decode, prefill_tp, decode_tp)`, plain
decoding): the prompts go through `backbone` (compiled with `tp=prefill_tp`), then each rank
keeps the requests its decode DP group serves (`Split.share`) and decodes them through
`decode` (compiled with `tp=decode_tp`, a divisor of `prefill_tp`). The hand-over
(`hand_over`) copies those requests' cache rows into a cache of their own: V4.1's attention has
one KV head, which tp does not split, so every rank of a prefill DP group holds the whole cache
of the group's requests, and a decode group inside it already holds the rows it will read --
no cache row crosses ranks. The tokens are gathered from the ranks that decoded them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from dsv41_compile.core.mesh import build_mesh
from dsv41_compile.core.torch_private import mark_unbacked
from dsv41_compile.deepseek_v41.model import DeepseekV41
from dsv41_compile.deepseek_v41.model.batches import Request, pack
from dsv41_compile.deepseek_v41.model.cache import KVCache
from dsv41_compile.frontend.tokens import mark_token_dim

__all__ = ["Decoded", "Split", "accept_sampled", "generate", "hand_over", "propose", "sample"]


@dataclass
class Decoded:
    """What `generate` made: the new tokens of each request, and per step (backbone call
    after the prefill) the tokens it added over all requests and the proposals it kept."""

    tokens: list[list[int]]
    step_tokens: list[int] = field(default_factory=list)
    step_accepted: list[int] = field(default_factory=list)
    step_proposed: list[int] = field(default_factory=list)
    step_requests: list[int] = field(default_factory=list)
    """Requests decoded in each step."""
    backbone_seconds: list[float] = field(default_factory=list)
    """Wall time of each backbone call (the prefill first; compiles included)."""
    drafter_seconds: list[float] = field(default_factory=list)
    """Wall time of each drafter call with its proposals' sampling."""

    @property
    def acceptance(self) -> float:
        """Kept proposals over proposals made."""
        return sum(self.step_accepted) / max(1, sum(self.step_proposed))

    @property
    def tokens_per_step(self) -> float:
        """Tokens a request gains per step, on average (1 without drafts)."""
        return sum(self.step_tokens) / max(1, sum(self.step_requests))


def sample(logits_V: Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The argmax at temperature 0; otherwise a draw from `softmax(logits / temperature)`."""
    if temperature == 0:
        return int(logits_V.argmax())
    probs = torch.softmax(logits_V.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def accept_sampled(
    drafts: Sequence[int],
    q_DV: Tensor,
    p_RV: Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Rejection sampling of `drafts` (each drawn from its row of `q_DV`) against the target
    distributions `p_RV` (D + 1 rows: the one before each draft, then the one after the last):
    `(kept, next token)`. The kept drafts and the next token are distributed as drawing each
    from `p` in turn."""
    for j, d in enumerate(drafts):
        p, q = p_RV[j], q_DV[j]
        u = torch.rand((), generator=generator)
        if float(u) * float(q[d]) <= float(p[d]):  # u < p/q without dividing by q(d)
            continue
        residual = (p - q).clamp(min=0)
        return j, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(drafts), int(torch.multinomial(p_RV[len(drafts)], 1, generator=generator))


@dataclass
class _Request:
    slot: int
    tokens: list[int]
    """Every token known, from position 0: the prompt, then what was generated."""
    prompt: int
    held: int = 0
    """Positions in the backbone's cache."""
    drafter_held: int = 0
    """Positions in the drafter's cache."""
    drafts: list[int] = field(default_factory=list)
    q: Tensor | None = None
    """The drafter's distributions the drafts were sampled from (temperature > 0)."""

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt

    @property
    def pending(self) -> int:
        """Known tokens not in the backbone's cache (the next one, and one a cut dropped)."""
        return len(self.tokens) - self.held


def _accept(
    drafts: list[int],
    q_DV: Tensor | None,
    logits_RV: Tensor,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """(drafts kept, the next token) from the backbone's logits before each draft and after
    the last: greedy, or rejection sampling (`accept_sampled`)."""
    if temperature > 0:
        p_RV = torch.softmax(logits_RV.float() / temperature, dim=-1)
        # q_DV is None only without drafts, when no row of it is read
        return accept_sampled(drafts, cast(Tensor, q_DV), p_RV, generator)
    kept = 0
    while kept < len(drafts) and drafts[kept] == int(logits_RV[kept].argmax()):
        kept += 1
    return kept, int(logits_RV[kept].argmax())


@dataclass(frozen=True)
class Split:
    """Decode in another layout than the prefill's, on the same ranks: `decode` is the model
    compiled with `tp=decode_tp`; `generate`'s `backbone` the one compiled with
    `tp=prefill_tp`."""

    decode: Callable[..., Any]
    prefill_tp: int
    decode_tp: int

    def __post_init__(self) -> None:
        if min(self.prefill_tp, self.decode_tp) < 1 or self.prefill_tp % self.decode_tp:
            raise ValueError(
                f"Split(prefill_tp={self.prefill_tp}, decode_tp={self.decode_tp}): decode_tp "
                "must divide prefill_tp, so that each decode DP group lies inside the prefill "
                "group that holds its requests' cache (a hand-over across prefill groups would "
                "move cache rows between ranks, which is not built)"
            )

    def share(self, rank: int, requests: int) -> list[int]:
        """The requests (0 .. `requests` - 1, those of `rank`'s prefill DP group) that `rank`'s
        decode DP group serves: the prefill group's `prefill_tp / decode_tp` decode groups take
        them in turn."""
        groups = self.prefill_tp // self.decode_tp
        mine = (rank % self.prefill_tp) // self.decode_tp
        return [i for i in range(requests) if i % groups == mine]


def hand_over(cache: KVCache, slots: Sequence[int], into: KVCache) -> None:
    """Copy requests `slots` of `cache` into slots 0 .. len(slots) - 1 of `into` (every cache
    tensor: lengths, window rings, compressed and indexer entries, pair states, n-gram ids)."""
    if len(slots) > into.num_slots or cache.max_len != into.max_len:
        raise ValueError(
            f"hand_over: {len(slots)} requests of max_len {cache.max_len} into a cache of "
            f"{into.num_slots} slots of max_len {into.max_len}"
        )
    index = torch.tensor(list(slots), dtype=torch.int64)
    for source, target in zip(cache.tensors(), into.tensors(), strict=True):
        target[: len(slots)] = source[index]


def generate(
    model: DeepseekV41,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    speculative: bool = True,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    backbone: Callable[..., Any] | None = None,
    drafter: Callable[..., Any] | None = None,
    max_len: int | None = None,
    on_step: Callable[[int], None] | None = None,
    split: Split | None = None,
) -> Decoded:
    """Decode `max_new_tokens` after each prompt, all requests packed into each call.

    `speculative`: with the DSpark drafter (`model.mtp`, which the config must have); plain
    decoding otherwise. `temperature` 0 is greedy. `backbone` / `drafter`: what to call for
    `model` and `model.mtp` (their compiled programs; the modules by default). `max_len`: the
    cache's positions per request (default: the longest prompt plus what it may need).
    `on_step(n)` is called after each step with the tokens it added (a progress bar).
    `split`: decode in another layout than the prefill (module docstring; needs a process
    group and `speculative=False`); every rank returns every request's tokens."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, each of at least one token")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    cfg = model.cfg
    if speculative and not cfg.num_nextn_predict_layers:
        raise ValueError(
            "speculative=True drafts with the DSpark stages; this model's config has none "
            "(num_nextn_predict_layers = 0): use speculative=False"
        )
    block = cfg.dspark_block_size if speculative else 0
    if speculative and block + 2 > cfg.window_size:
        raise ValueError(
            f"a verify call feeds up to {block + 2} positions per request, more than the window "
            f"of {cfg.window_size}: its cache could not be cut back (DeepseekV41.save_rows)"
        )
    if split is not None and speculative:
        raise ValueError(
            "split= decodes plainly: pass speculative=False (the drafter's cache is not handed "
            "over)"
        )
    backbone = model if backbone is None else backbone
    if drafter is None and speculative:
        drafter = model.mtp
    longest = max(len(p) for p in prompts)
    max_len = max_len or longest + max_new_tokens + block + 2
    cache = model.new_cache(len(prompts), max_len)
    draft_cache = model.mtp.new_cache(len(prompts)) if speculative else None
    requests = [_Request(slot, list(p), len(p)) for slot, p in enumerate(prompts)]
    out = Decoded(tokens=[[] for _ in prompts])

    def draft(batch: Sequence[_Request], verified: _Verified) -> None:
        args = (draft_cache, verified, temperature, generator, out, max_new_tokens)
        # called when speculative only, where drafter is set (model.mtp by default)
        _draft(model, cast(Callable[..., Any], drafter), batch, *args)

    with torch.no_grad():
        # prefill: the prompts, then the first token and the first proposals
        verified = _call_backbone(backbone, requests, cache, speculative, out)
        for r in requests:
            last = verified.logit_rows[r.slot][1] - 1
            r.tokens.append(sample(verified.logits[last], temperature, generator))
            r.held = r.prompt
        if speculative:
            draft(requests, verified)
        out.step_tokens.append(len(requests))
        out.step_requests.append(len(requests))
        if on_step:
            on_step(len(requests))
        if split is not None:
            return _decode_split(
                model, split, requests, cache, max_new_tokens, temperature, generator, out
            )

        while active := [r for r in requests if r.generated < max_new_tokens]:
            saved = {
                r.slot: model.save_rows(cache, r.slot, r.held, r.pending + len(r.drafts))
                for r in active
                if r.drafts
            }
            verified = _call_backbone(backbone, active, cache, speculative, out)
            kept_total = proposed = 0
            for r in active:
                first, stop = verified.logit_rows[r.slot]
                # the logits before each draft, and after the last
                before = verified.logits[first:stop]
                kept, nxt = _accept(r.drafts, r.q, before, temperature, generator)
                keep = r.held + r.pending + kept  # positions fed and right
                r.tokens += r.drafts[:kept] + [nxt]
                kept_total, proposed = kept_total + kept, proposed + len(r.drafts)
                cut = keep
                if kept < len(r.drafts):  # rows of rejected drafts were written: put back
                    cut = model.cache_cut(keep)
                    model.cut_cache(cache, saved[r.slot], cut, r.tokens)
                r.held, r.drafts, r.q = cut, [], None
            if speculative:
                draft(active, verified)
            out.step_tokens.append(kept_total + len(active))
            out.step_accepted.append(kept_total)
            out.step_proposed.append(proposed)
            out.step_requests.append(len(active))
            if on_step:
                on_step(kept_total + len(active))
    for r in requests:
        out.tokens[r.slot] = r.tokens[r.prompt :]
    return out


def _decode_split(
    model: DeepseekV41,
    split: Split,
    requests: list[_Request],
    cache: KVCache,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator | None,
    out: Decoded,
) -> Decoded:
    """`generate`'s decode steps in `split.decode`'s layout: this rank's share of the requests
    handed over to a cache of their own, one token per step for each (a rank whose group has
    no request still joins every step with none: the EP exchange needs every rank); then every
    prefill group's tokens gathered."""
    mine = split.share(dist.get_rank(), len(requests))
    own = model.new_cache(max(1, len(mine)), cache.max_len)
    hand_over(cache, mine, own)
    local = [
        _Request(i, requests[slot].tokens, requests[slot].prompt, held=requests[slot].held)
        for i, slot in enumerate(mine)
    ]
    for _ in range(max_new_tokens - 1):
        verified = _call_backbone(split.decode, local, own, False, out)
        for r in local:
            first, _ = verified.logit_rows[r.slot]
            r.held = len(r.tokens)
            r.tokens.append(sample(verified.logits[first], temperature, generator))
        out.step_tokens.append(len(local))
        out.step_requests.append(len(local))
    # the prefill DP group's ranks: the requests' decode groups are among them
    group = build_mesh(tp=split.prefill_tp, ep=1, device_type=cache.lengths.device.type)
    decoded: list[Any] = [None] * split.prefill_tp
    mine_tokens = {slot: r.tokens for slot, r in zip(mine, local)}
    dist.all_gather_object(decoded, mine_tokens, group=group.tp_mesh.get_group())
    for tokens_of in decoded:
        for slot, tokens in tokens_of.items():
            out.tokens[slot] = tokens[requests[slot].prompt :]
    return out


@dataclass
class _Verified:
    """One backbone call: the logits of the rows it asked for, each slot's rows of the batch
    and of those logits, and (speculative) the captures the drafter reads with their
    positions and slots."""

    logits: Tensor
    rows: dict[int, tuple[int, int]]
    logit_rows: dict[int, tuple[int, int]]
    positions: Tensor
    slots: Tensor
    hidden: Tensor | None


def _call_backbone(
    backbone: Callable[..., Any],
    requests: Sequence[_Request],
    cache: Any,
    speculative: bool,
    out: Decoded,
) -> _Verified:
    """One packed call: each request's tokens from its cache's length on, then its drafts. It
    asks for the logits the step reads (`logit_rows`): the one before each draft and the one
    after the last (the last row alone without drafts)."""
    batch, rows, at, start = [], {}, {}, 0
    asked: list[int] = []
    for r in requests:
        fed = r.tokens[r.held :] + r.drafts
        batch.append(Request(r.slot, fed, r.held))
        stop = start + len(fed)
        rows[r.slot] = (start, stop)
        first = start + r.pending - 1
        at[r.slot] = (len(asked), len(asked) + stop - first)
        asked += range(first, stop)
        start = stop
    ids, positions, slots = pack(batch)
    logit_rows = torch.tensor(asked, dtype=torch.int64)
    # one compiled program for every step's token count and count of rows asked for
    mark_token_dim(ids, positions, slots)
    mark_unbacked(logit_rows, 0)
    hidden, began = None, time.perf_counter()
    if speculative:
        logits, hidden = backbone(ids, positions, slots, cache, hidden=True, logit_rows=logit_rows)
    else:
        logits = backbone(ids, positions, slots, cache, logit_rows=logit_rows)
    out.backbone_seconds.append(time.perf_counter() - began)
    return _Verified(logits, rows, at, positions, slots, hidden)


def _draft(
    model: DeepseekV41,
    drafter: Callable[..., Any],
    requests: Sequence[_Request],
    cache: Any,
    verified: _Verified,
    temperature: float,
    generator: torch.Generator | None,
    out: Decoded,
    max_new_tokens: int,
) -> None:
    """The drafter's call for the unfinished `requests`: the captures of their newly kept
    positions into its cache, a block after each, then the proposals sampled in order."""
    cfg = model.cfg
    todo = [r for r in requests if r.generated < max_new_tokens]
    if not todo:
        return
    hidden, positions, slots = verified.hidden, verified.positions, verified.slots
    assert hidden is not None, "a speculative verify captures the drafter's input"
    take: list[int] = []
    blocks = []
    for r in todo:
        start, stop = verified.rows[r.slot]
        known = len(r.tokens) - 1  # positions with their token fed and right
        for i in range(start, stop):
            if r.drafter_held <= int(positions[i]) < known:
                take.append(i)
        r.drafter_held = known
        noise = [cfg.dspark_noise_token_id] * (cfg.dspark_block_size - 1)
        blocks.append(Request(r.slot, [r.tokens[-1], *noise], known))
    index = torch.tensor(take, dtype=torch.int64)
    ids, block_positions, block_slots = pack(blocks)
    context = hidden[index], positions[index], slots[index]
    mark_token_dim(ids, block_positions, block_slots, *context)
    began = time.perf_counter()
    logits, _ = drafter(ids, block_positions, block_slots, cache, *context)
    for b, r in enumerate(todo):
        budget = max_new_tokens - r.generated - 1  # the verify adds one token of its own
        rows_BV = logits[b * cfg.dspark_block_size : (b + 1) * cfg.dspark_block_size]
        count = min(budget, cfg.dspark_block_size)
        r.drafts, r.q = propose(model, rows_BV, r.tokens[-1], count, temperature, generator)
    out.drafter_seconds.append(time.perf_counter() - began)


def propose(
    model: DeepseekV41,
    logits_BV: Tensor,
    first: int,
    count: int,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[list[int], Tensor | None]:
    """`count` proposals from a draft block's logits, in order: row i's logits plus the Markov
    bias of the token before (`first`, then each proposal) give the next one. Returns them and,
    when sampling (temperature > 0), the distributions they were drawn from."""
    markov = model.mtp.markov_head
    previous, drafts, q = first, [], []
    with torch.no_grad():
        for i in range(count):
            bias, _ = markov(torch.tensor([previous]))
            biased = logits_BV[i] + bias[0]
            if temperature > 0:
                q.append(torch.softmax(biased.float() / temperature, dim=-1))
            previous = sample(biased, temperature, generator)
            drafts.append(previous)
    return drafts, torch.stack(q) if q else None
