"""The options of the `dsv41_sp` backend: `torch.compile(..., options={...})`.

One dict holds two kinds: the generic options every model family has (`BackendOptions`: the
mesh, the EP lowering, the layout's name, the target, the weight budget, dumps, the host
cache, the checkpoint) and the options a model family declares for itself (a `FamilyOptions`
class, `ModelAdapter.options`; DeepSeek V4.1's are `deepseek_v41.options`). The backend
checks the generic ones at once and the family's once it knows the model's family
(`families.options_for`); a name that is neither is a ValueError listing both."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dsv41_compile.devices import DEVICES, Device

__all__ = [
    "LOWERINGS",
    "BackendOptions",
    "FamilyOptions",
    "GivenOptions",
    "Lowering",
    "check_choice",
    "register_lowering",
]

_EP_DISPATCH = ("auto", "exact", "padded")
_EP_ROWS = ("auto", "per_rank", "per_assignment")

F = TypeVar("F", bound="FamilyOptions")


@dataclass(frozen=True)
class Lowering:
    """What the options know of a lowering: each target declares it (`targets.Target`) and
    `targets` registers it, so the options check a lowering's name and needs without naming
    one."""

    name: str
    auto_for: tuple[str, ...] = ()
    """The device types `lowering="auto"` picks it for (the first registered that serves one)."""
    whole_graph: str | None = None
    """What it makes of a graph when it runs the graph on the device as a whole ("a captured
    ACL graph"); such a lowering needs the padded EP dispatch with ep > 1 (the exact one reads
    the assignment counts on the host), and `ep_dispatch="auto"` picks the padded one for it.
    None: the graph runs op by op, the host in the loop."""
    fused_ops: bool = False
    """Whether it hands the model's fused ops (`ModelAdapter.fused_ops`) to fused kernels, as
    the model's graph-mode rewrites say; otherwise they are traced as their ATen decompositions."""


LOWERINGS: dict[str, Lowering] = {}
"""The lowerings, by name, in the order they were registered (`register_lowering`)."""


def register_lowering(lowering: Lowering) -> None:
    """Make `lowering` a value of the `lowering` option (a name registered twice is replaced)."""
    LOWERINGS[lowering.name] = lowering


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    """A ValueError when option `name`'s `value` is not one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {allowed}")


@dataclass(frozen=True, kw_only=True)
class FamilyOptions:
    """The options a model family declares beside the generic ones: subclass it as a frozen,
    keyword-only dataclass, a docstring per field, checked in `__post_init__`, and name the
    class in the family's adapter (`ModelAdapter.options`). A family without options of its own
    has this class, which has none."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_items(cls: type[F], items: Iterable[tuple[str, Any]]) -> F:
        """The options of `items` (name, value) -- names of this class (`families.options_for`
        checks them first) -- the rest at their defaults."""
        return cls(**dict(items))

    def items(self) -> tuple[tuple[str, Any], ...]:
        """The options as (name, value) pairs, in field order."""
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))


@dataclass(frozen=True, kw_only=True)
class GivenOptions(FamilyOptions):
    """A family's options as the user gave them, before the backend knows which family the
    model is (`families.options_for` turns them into the family's class)."""

    given: tuple[tuple[str, Any], ...] = ()

    def items(self) -> tuple[tuple[str, Any], ...]:
        return self.given


@dataclass(frozen=True, kw_only=True)
class BackendOptions:
    tp: int = 1
    """Tensor-parallel (and sequence-parallel) group size; the world splits into world/tp DP
    groups of consecutive ranks."""
    ep: int = 1
    """Expert-parallel group size: the world size (rank r holds routed experts
    [r*E/ep, (r+1)*E/ep) and the routed-experts op becomes an all-to-all dispatch / combine
    over the world), or 1 (every rank holds every routed expert)."""
    ep_dispatch: str = "auto"
    """How the EP all-to-all is sized: "exact" (exchange per-destination counts, then send
    exactly the valid assignments; data-dependent sizes) or "padded" (every rank sends a
    worst-case buffer of ceil(T/tp) * min(top-k, E/ep) rows to every rank; no host sync, the
    form graph-mode compilers run). "auto": padded for torchair; otherwise the shorter MoE
    layer on `device` at `rows_per_step` (exact pays the count exchange and the host's read of
    the counts, padded the worst-case rows' bytes: the choice and both times are in graph.py,
    comm.json and tools/explain.py)."""
    ep_rows: str = "auto"
    """What one dispatched row is: "per_assignment" (one row per (token, expert) pair; a token
    goes to a rank once per expert of it the rank holds) or "per_rank" (one row per (token,
    destination rank) with that rank's expert ids and weights; the expert rank sums its experts'
    outputs in fp32 and sends one row back, in the activation dtype).
    "auto": per MoE layer, the one with fewer expected bytes under uniform routing (the
    choice and both figures are in graph.py, comm.json and tools/explain.py)."""
    device: str | Device = "auto"
    """The device the "auto" cuts are chosen for, by the time a step would take on it
    (`devices.DEVICES`: "950dt", "950pr", "a3", "a2", "h200"; docs/devices.md, or a
    `devices.Device` of your own) at the workload `rows_per_step` states. "auto": the H200 for
    CUDA tensors, else the Ascend 950DT (on CPU, where nothing is timed, the NPU the program is
    meant for)."""
    rows_per_step: int = 8
    """The rows (tokens) one DP group's step is expected to carry, for the "auto" cuts: a small
    decode batch unless said otherwise (8 requests decoding, or one verifying 7 rows). A
    deployment that serves long prefills in this program says so with more."""
    extra_weight_bytes: int | None = None
    """The most bytes of weights per rank the family's cuts may replicate beyond the layout's
    own shards (None: no limit; 0: none, so an "auto" cut never replicates a weight)."""
    layout: str = "sp"
    """A layout of the model family's adapter (`ModelAdapter.layouts`, checked when the backend
    compiles). DeepSeek V4.1's: "sp" (token-sharded residuals, AllGather in / ReduceScatter out
    of attention) and "replicated" (the all-reduce baseline sp replaces: docs/backend.md)."""
    lowering: str = "auto"
    """"eager", "inductor", "npugraph_ex" (Ascend NPU, ACL graph capture of each step's
    size; needs torch_npu and ep_dispatch="padded"), "torchair" (Ascend NPU, torchair's GE
    graph mode; the same needs), or "auto" (inductor on CPU / GPU, npugraph_ex on NPU)."""
    capture_tokens: int = 128
    """lowering="npugraph_ex": a call of at most this many tokens (a DP group's step: decode,
    verify) runs as an ACL graph captured on the first call of its size; a longer one (a
    prefill) runs uncaptured."""
    dump_dir: str | None = None
    """Where to write `rank{r}/graph.py` and `rank{r}/comm.json` at compile time."""
    dump_after: tuple[str, ...] = ()
    """Pass names (`dsv41_compile.pipeline.pass_names()`, checked when the backend compiles)
    after which the graph is written to `dump_dir/rank{r}/after_{pass}.py` (or a temporary
    folder the log names)."""
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
    (DeepSeek V4.1: the vision tower) without them."""
    share_compile: bool = True
    """One rank per host compiles a per-rank program; the host's other ranks load it
    (`runtime.host_cache`, under inductor's cache directory). False: every rank compiles."""
    family: FamilyOptions = field(default_factory=FamilyOptions)
    """The model family's own options, given in the same dict as the others (DeepSeek V4.1:
    `attn_entry`, `attn_exit`, `embedding`, `head`, `engram`, `shared_expert`, `npu_attention`):
    `GivenOptions` until the backend knows the family, then an instance of its class
    (`ModelAdapter.options`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be a positive int, got {self.tp!r}")
        if not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"ep must be a positive int, got {self.ep!r}")
        check_choice("lowering", self.lowering, ("auto", *sorted(LOWERINGS)))
        check_choice("ep_dispatch", self.ep_dispatch, _EP_DISPATCH)
        check_choice("ep_rows", self.ep_rows, _EP_ROWS)
        self._check_target(self.lowering)
        if not isinstance(self.device, Device):
            check_choice("device", self.device, ("auto", *DEVICES))
        if not isinstance(self.capture_tokens, int) or self.capture_tokens < 0:
            raise ValueError(f"capture_tokens must be an int >= 0, got {self.capture_tokens!r}")
        if not isinstance(self.rows_per_step, int) or self.rows_per_step < 1:
            raise ValueError(f"rows_per_step must be a positive int, got {self.rows_per_step!r}")
        budget = self.extra_weight_bytes
        if budget is not None and (not isinstance(budget, int) or budget < 0):
            raise ValueError(f"extra_weight_bytes must be None or an int >= 0, got {budget!r}")
        if self.checkpoint is not None and not isinstance(self.checkpoint, str):
            object.__setattr__(self, "checkpoint", os.fspath(self.checkpoint))
        if self.skip_unimplemented_parts and self.checkpoint is None:
            raise ValueError("skip_unimplemented_parts applies to the checkpoint option only")

    def _check_target(self, lowering: str) -> None:
        if lowering == "auto":  # checked again when the device resolves it (`target`)
            return
        makes = LOWERINGS[lowering].whole_graph
        if makes is not None and self.ep > 1 and self.ep_dispatch == "exact":
            how = (
                f"lowering='auto' chose {lowering} (NPU tensors)"
                if self.lowering == "auto"
                else (f"lowering='{lowering}'")
            )
            raise ValueError(
                f"{how} needs ep_dispatch='padded' with ep > 1: the exact EP lowering reads "
                f"the assignment counts on the host (data-dependent sizes), which "
                f"{makes} cannot run"
            )

    @staticmethod
    def names() -> tuple[str, ...]:
        """The generic options' names (`family` is not one: its options are given by name)."""
        return tuple(f.name for f in dataclasses.fields(BackendOptions) if f.name != "family")

    @staticmethod
    def from_dict(options: dict[str, Any] | None) -> BackendOptions:
        """The generic options of `options`, checked; the other names kept as the family's,
        `GivenOptions`, for `families.options_for` to check against the model's family."""
        options = dict(options or {})
        generic = {k: v for k, v in options.items() if k in BackendOptions.names()}
        given = tuple(sorted((k, v) for k, v in options.items() if k not in generic))
        if isinstance(generic.get("dump_after"), (list, str)):
            after = generic["dump_after"]
            generic["dump_after"] = (after,) if isinstance(after, str) else tuple(after)
        return BackendOptions(**generic, family=GivenOptions(given=given))

    def target(self, device_type: str) -> str:
        """The lowering for tensors on `device_type` ("auto" resolved), checked against the
        other options."""
        lowering = self.lowering
        if lowering == "auto":
            serving = [name for name, low in LOWERINGS.items() if device_type in low.auto_for]
            if serving:
                lowering = serving[0]
            else:
                raise ValueError(
                    f"lowering='auto' has no compiler for device {device_type!r}; pass "
                    "lowering='eager'"
                )
        self._check_target(lowering)
        return lowering

    def device_model(self, device_type: str) -> Device:
        """The device the "auto" cuts are timed on, for tensors on `device_type`."""
        if isinstance(self.device, Device):
            return self.device
        if self.device != "auto":
            return DEVICES[self.device]
        return DEVICES["h200" if device_type == "cuda" else "950dt"]

    def cache_key(self) -> tuple[tuple[str, Any], ...]:
        """The options that change the per-rank program (not where it is dumped, nor where
        its weights come from)."""
        skip = {
            "dump_dir", "dump_after", "check_inputs", "share_compile", "checkpoint",
            "skip_unimplemented_parts", "family",
        }  # fmt: skip
        generic = tuple((n, getattr(self, n)) for n in self.names() if n not in skip)
        return (*generic, ("family", (type(self.family).__name__, self.family.items())))
