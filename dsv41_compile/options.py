"""The options of the `dsv41_sp` backend: `torch.compile(..., options={...})`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["BackendOptions"]

_LOWERINGS = ("auto", "eager", "inductor", "torchair")
_EMBEDDINGS = ("replicated", "vocab_sharded")
_EP_DISPATCH = ("exact", "padded")
_EP_ROWS = ("auto", "per_rank", "per_assignment")
_ATTN_EXITS = ("auto", "reduce_scatter", "all_to_all")
_ATTN_ENTRIES = ("auto", "input")
_ENGRAM = ("auto", "replicated", "sharded", "host")


@dataclass(frozen=True, kw_only=True)
class BackendOptions:
    tp: int = 1
    """Tensor-parallel (and sequence-parallel) group size; the world splits into world/tp DP
    groups of consecutive ranks."""
    ep: int = 1
    """Expert-parallel group size: the world size (rank r holds routed experts
    [r*E/ep, (r+1)*E/ep) and the routed-experts op becomes an all-to-all dispatch / combine
    over the world), or 1 (every rank holds every routed expert)."""
    ep_dispatch: str = "exact"
    """How the EP all-to-all is sized: "exact" (exchange per-destination counts, then send
    exactly the valid assignments; data-dependent sizes) or "padded" (every rank sends a
    worst-case buffer of ceil(T/tp) * min(top-k, E/ep) rows to every rank; no host sync, the
    form graph-mode compilers run)."""
    ep_rows: str = "auto"
    """What one dispatched row is: "per_assignment" (one row per (token, expert) pair; a token
    goes to a rank once per expert of it the rank holds) or "per_rank" (one row per (token,
    destination rank) with that rank's expert ids and weights; the expert rank sums its experts'
    outputs in fp32 and sends one row back, in the activation dtype).
    "auto": per MoE layer, the one with fewer expected bytes under uniform routing (the
    choice and both figures are in graph.py, comm.json and tools/explain.py)."""
    attn_entry: str = "auto"
    """What attention's entry AllGather moves in the sp layout: "input" (the normed `[Tl, D]`
    input: the requirement's layout) or "auto" (per layer, the cheapest cut between the input
    and the ops that need all tokens: the per-token ops before it -- projections with
    replicated weights, norms, rope -- run on the token shard and their narrower outputs are
    gathered; the input itself when nothing is cheaper). The choice and its bytes are in
    graph.py, comm.json and tools/explain.py."""
    attn_exit: str = "auto"
    """How attention's output leaves the TP group in the sp layout: "reduce_scatter" (the
    row-parallel output projection's fp32 partial sum, reduce-scattered to token shards: the
    requirement's layout) or "all_to_all" (the projection's input moves to the token shards in
    the activation dtype and each rank runs the whole projection on its tokens: no cross-rank
    sum, exact, but the projection's weight is replicated on every TP rank). "auto": the one
    with fewer bytes, unless the replicated weights exceed `extra_weight_bytes`. The model
    family decides what the projection is (DeepSeek V4.1: `wo_b`)."""
    engram: str = "auto"
    """Where DeepSeek V4.1's Engram tables live: "replicated" (whole on every rank),
    "sharded" (split by their hash columns over the world, ep = world: each rank holds about
    1/world of the rows, and each Engram layer sends every token's row ids to the ranks holding
    their columns and gets the rows back in FP8 with their scales, two all-to-alls), "host"
    (sharded, each rank's rows in host memory, looked up there), or "auto": sharded when ep is
    the world and replicating the tables would hold more than 1 GiB per rank (or more than
    `extra_weight_bytes`), else replicated. The choice, its memory and its bytes are in graph.py,
    comm.json and tools/explain.py."""
    extra_weight_bytes: int | None = None
    """The most bytes of weights per rank the cuts may replicate beyond the layout's own
    shards (None: no limit; 0: none, so "auto" never replicates a weight)."""
    layout: str = "sp"
    """A layout of the model family's adapter (`ModelAdapter.layouts`, checked when the backend
    compiles). DeepSeek V4.1's:
    "sp": token-sharded residuals, AllGather in / ReduceScatter out of attention.
    "replicated": the baseline sp replaces: residuals replicated over the TP group, attention
    output all-reduced, with ep > 1 each token dispatched by one TP rank and the MoE output
    all-gathered back (docs/backend.md)."""
    lowering: str = "auto"
    """"eager", "inductor", "torchair" (Ascend NPU graph mode; needs torch_npu and
    ep_dispatch="padded"), or "auto" (inductor on CPU / GPU, torchair on NPU)."""
    dump_dir: str | None = None
    """Where to write `rank{r}/graph.py` and `rank{r}/comm.json` at compile time."""
    dump_after: tuple[str, ...] = ()
    """Pass names (`dsv41_compile.pipeline.PASS_NAMES`, checked when the backend compiles)
    after which the graph is written to `dump_dir/rank{r}/after_{pass}.py` (or a temporary
    folder the log names)."""
    embedding: str = "replicated"
    """"replicated" (local lookup of the token shard) or "vocab_sharded" (rows sharded over
    tp; the partial lookups are reduce-scattered to the token shards)."""
    check_inputs: bool = False
    """Debugging aid: before every call, check that the ranks of each TP group received the
    same token inputs (one all-gather of the token count and one of the inputs over the TP
    group, and a host read); a mismatch raises a ValueError naming the ranks and the first row
    that differs, where otherwise it would give wrong logits."""
    checkpoint: str | None = None
    """A checkpoint directory in the released format (`model.safetensors.index.json` and its
    shards). Each rank reads only its own slices of the weights when its first program is
    built, and runs on them instead of the model's parameters, which may then have no memory
    (`DeepseekV41.without_weights(cfg)`). Loading is strict: see `load_checkpoint`."""
    skip_unimplemented_parts: bool = False
    """With `checkpoint`: load a checkpoint that holds parts the model does not implement
    (DeepSeek V4.1's Engram, DSpark draft blocks, vision tower) without them; the outputs then
    differ from the released model's."""
    share_compile: bool = True
    """One rank per host compiles a per-rank program; the host's other ranks load it
    (`runtime.host_cache`, under inductor's cache directory). False: every rank compiles."""

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be a positive int, got {self.tp!r}")
        if not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"ep must be a positive int, got {self.ep!r}")
        for name, allowed in (
            ("lowering", _LOWERINGS),
            ("embedding", _EMBEDDINGS),
            ("ep_dispatch", _EP_DISPATCH),
            ("ep_rows", _EP_ROWS),
            ("attn_exit", _ATTN_EXITS),
            ("attn_entry", _ATTN_ENTRIES),
            ("engram", _ENGRAM),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not supported; choose one of {allowed}"
                )
        self._check_target(self.lowering)
        budget = self.extra_weight_bytes
        if budget is not None and (not isinstance(budget, int) or budget < 0):
            raise ValueError(f"extra_weight_bytes must be None or an int >= 0, got {budget!r}")
        if self.checkpoint is not None and not isinstance(self.checkpoint, str):
            object.__setattr__(self, "checkpoint", os.fspath(self.checkpoint))
        if self.skip_unimplemented_parts and self.checkpoint is None:
            raise ValueError("skip_unimplemented_parts applies to the checkpoint option only")

    def _check_target(self, lowering: str) -> None:
        if lowering == "torchair" and self.ep > 1 and self.ep_dispatch == "exact":
            how = (
                "lowering='auto' chose torchair (NPU tensors)"
                if self.lowering == "auto"
                else ("lowering='torchair'")
            )
            raise ValueError(
                f"{how} needs ep_dispatch='padded' with ep > 1: the exact EP lowering reads "
                "the assignment counts on the host (data-dependent sizes), which torchair's GE "
                "graphs cannot run"
            )

    @staticmethod
    def from_dict(options: dict[str, Any] | None) -> BackendOptions:
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(BackendOptions)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown dsv41_sp option(s) {unknown}; the options are {sorted(known)}"
            )
        if isinstance(options.get("dump_after"), (list, str)):
            after = options["dump_after"]
            options["dump_after"] = (after,) if isinstance(after, str) else tuple(after)
        return BackendOptions(**options)

    def target(self, device_type: str) -> str:
        """The lowering for tensors on `device_type` ("auto" resolved), checked against the
        other options."""
        lowering = self.lowering
        if lowering == "auto":
            if device_type in ("cpu", "cuda"):
                lowering = "inductor"
            elif device_type == "npu":
                lowering = "torchair"
            else:
                raise ValueError(
                    f"lowering='auto' has no compiler for device {device_type!r}; pass "
                    "lowering='eager'"
                )
        self._check_target(lowering)
        return lowering

    def cache_key(self) -> tuple[tuple[str, Any], ...]:
        """The options that change the per-rank program (not where it is dumped, nor where
        its weights come from)."""
        skip = {
            "dump_dir", "dump_after", "check_inputs", "share_compile", "checkpoint",
            "skip_unimplemented_parts",
        }  # fmt: skip
        return tuple(
            (f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in skip
        )
