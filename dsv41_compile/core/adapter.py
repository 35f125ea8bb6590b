"""What the compiler needs to know about a model family, in one object.

The passes are generic: they place, communicate, localize and verify any graph. What is
specific to a model -- the sharding plan, which inputs carry the token count, where a decoder
layer and its MoE half are, the routed-experts op, the layout's collectives per layer, the ops
graph mode must rewrite -- comes from the family's `ModelAdapter` (`deepseek_v41/adapter.py` for the built-in family), and generic code
never names a module of a particular model.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from dsv41_compile.core.plan import ShardingPlan
from dsv41_compile.core.torch_private import OpOverload
from dsv41_compile.options import BackendOptions, FamilyOptions, Lowering

__all__ = [
    "PARTS",
    "LayerCollectives",
    "ModelAdapter",
    "RoutedExperts",
    "Site",
    "TableLookup",
    "WeightInput",
    "WeightRange",
    "WeightSlice",
]

PARTS = ("entry", "attention", "moe", "exit")
"""The parts of a model a node belongs to: before the first decoder layer, a layer's attention
half, its MoE half, after the last layer."""


@dataclass(frozen=True)
class Site:
    """Where a module sits: its decoder layer (None outside the layers) and its part. `part` is
    one of PARTS, or "layer" for a node directly in a decoder layer (between its halves)."""

    layer: int | None
    part: str


@dataclass(frozen=True)
class RoutedExperts:
    """A routed-experts op of the model, with the contract the MoE passes rely on:

        op(x [T, D], topk_idx [T, K] int64, topk_weight [T, K] fp32, *weights, *constants)
            -> [T, D] fp32,   out[t] = sum_k topk_weight[t, k] * expert_{topk_idx[t, k]}(x[t])

    `weights` are the `n_weights` stacked expert weights, expert dim first (the EP shard dim):
    the matrices, each followed by its scale when `scaled` (a quantised format), each matrix
    holding `inputs_per_element` of its inputs per element of its last dim (2: packed FP4);
    `topk_idx == -1` is "no assignment" (a padding row routes nowhere)."""

    op: OpOverload
    n_weights: int = 3
    inputs_per_element: int = 1
    scaled: bool = False

    TOKEN_ARGS = (0, 1, 2)
    NO_EXPERT = -1

    def weight_args(self) -> range:
        return range(3, 3 + self.n_weights)

    def matrix_args(self) -> range:
        """The positions of the weight matrices among the op's arguments (their scales not)."""
        return range(3, 3 + self.n_weights, 2 if self.scaled else 1)

    def pad_value(self, position: int) -> int:
        """The value of a padding row of token input `position`: -1 for `topk_idx`, else 0."""
        return self.NO_EXPERT if position == 1 else 0


@dataclass(frozen=True)
class TableLookup:
    """A table-lookup op of the model, with the contract the `tables` pass relies on:

        op(table [N, W], scale [N, S], rows int64 [T, C], columns [C + 1], *constants)
            -> [T, C, W'] = dequantize(table[rows], scale[rows], *constants)

    Column c's rows are `[columns[c], columns[c + 1])` and `rows[:, c]` is one of them: a table
    split by its columns (`placements.ColumnShard`) sends each row id to the rank holding its
    column. `dequantize(codes, scales, *constants)` turns looked-up rows (`table`'s and
    `scale`'s, as their bytes: uint8) into the op's values; it is written with ATen ops, so
    that a pass can call it on FX proxies."""

    op: OpOverload
    dequantize: Callable[..., Any]

    TABLE_ARGS = (0, 1)
    ROWS, COLUMNS = 2, 3


@dataclass(frozen=True)
class LayerCollectives:
    """The TP collectives of a layout for each decoder layer of the family's stock model,
    outside its MoE half and in it (collective kinds). Not a promise about every model: an
    edited model may need others (a statistic over the tokens, a shift), which `verify` lists
    for `graph.py` as the layer's extra collectives with the op that needs each."""

    tp_outside_moe: tuple[str, ...]
    tp_in_moe: tuple[str, ...]


GraphModeRewrite = Callable[..., Any]
"""`rewrite(emit, val, *args, **kwargs) -> Proxy`: the op's value from ops torchair converts
(see `targets.npu_passes`)."""


class WeightSlice(NamedTuple):
    """Chunk `index` of `parts` equal chunks of dim `dim` of a parameter: a rank's tp shard, or
    (dim 0 of stacked expert weights) the experts an EP rank holds."""

    dim: int
    # the field shadows tuple.index, which mypy reports as an incompatible override; the field
    # is the class's API (and its repr), tuple.index is never called on a slice
    index: int  # type: ignore[assignment]
    parts: int

    def bounds(self, size: int) -> tuple[int, int]:
        step = size // self.parts
        return self.index * step, (self.index + 1) * step


class WeightRange(NamedTuple):
    """Elements `[start, stop)` of dim `dim` of a parameter: the rows of the columns a rank
    holds of a column-split table."""

    dim: int
    start: int
    stop: int

    def bounds(self, size: int) -> tuple[int, int]:
        return self.start, self.stop


@dataclass(frozen=True)
class ActivationRows:
    """A model's activation quantisation, for moving quantised rows (`spmd.quantised_transport`,
    the EP dispatch): `quantize(x)` rounds each block of `block` values along the last dim on
    its own (rows and blocks independent); `encode(x)` gives each row as `width(n)` bytes
    (uint8) and `decode(encode(x)) == quantize(x)`, bit for bit. `name` says what is moved
    (in `graph.py` and `comm.json`)."""

    quantize: OpOverload
    encode: OpOverload
    decode: OpOverload
    width: Callable[[int], int]
    block: int
    name: str


class WeightInput(NamedTuple):
    """A parameter a per-rank program takes: its FQN, global shape and dtype, and the slice of
    it this rank holds (None: all of it)."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    slice: WeightSlice | WeightRange | None


class ModelAdapter(abc.ABC):
    name: str
    options: type[FamilyOptions] = FamilyOptions
    """The family's own options (a `FamilyOptions` dataclass), given in the same dict as the
    generic ones; the methods below find them as `options.family`, an instance of this class."""
    token_inputs: tuple[str, ...]
    """Model inputs whose dim 0 is the token count; the first one's length is T."""
    layouts: tuple[str, ...] = ("sp",)
    """The values of the `layout` option this family has a plan for (`plan`)."""
    whole_model_modules: tuple[str, ...]
    """Top-level modules every graph of the whole model contains (a graph without them is a
    piece of the model: Dynamo split it at a graph break)."""
    routed_experts: tuple[RoutedExperts, ...] = ()
    """The model's routed-experts ops: `moe.expert_parallel` lowers them over the EP group."""
    table_lookups: tuple[TableLookup, ...] = ()
    """The model's table-lookup ops: `tables` lowers those of column-split tables."""
    rules: Mapping[OpOverload, Callable[..., Any]] = {}
    """Sharding rules of the model's custom ops (`spmd.rules.RuleFn`), asked first."""
    graph_mode_rewrites: Mapping[OpOverload, GraphModeRewrite] = {}
    """How graph mode computes the model's custom ops from ops torchair converts."""
    fused_ops: Mapping[OpOverload, Callable[..., Any]] = {}
    """The model's ops a lowering with fused kernels (`Lowering.fused_ops`) hands to one, as
    `graph_mode_rewrites` says, each with its decomposition (a function of the op's arguments,
    in torch ops): a lowering without them traces the op as that decomposition (`decomposed`),
    so that its program is the model's ATen and no sharding rule of the op is needed there."""
    activation_rows: ActivationRows | None = None
    """The model's activation quantisation, if it has one: collectives whose value it makes,
    or only feeds, move its quantised rows (`spmd.quantised_transport`)."""
    tp_divides: str = ""
    """What tp must divide in this family, in its own words, for the messages of the passes
    (DeepSeek V4.1: "n_heads and o_groups"); empty: the size of the sharded dim."""
    cache_inputs: tuple[str, ...] = ()
    """Prefixes of the input names (Dynamo's sources, `ctx.input_sources`) of the model's
    cache: tensors `[slots, ...]` of one slot per request and a scratch one, which the reports
    count as the cache (`report.accounting`, `report.step_time`; DeepSeek V4.1: `"cache."`)."""

    def decomposed(self, options: BackendOptions, lowering: Lowering) -> dict[OpOverload, Any]:
        """The fused ops traced as their decompositions for `lowering` under `options`: every
        one where the lowering has no fused kernels, none where it has. A family may keep more
        of them decomposed by its own options."""
        return {} if lowering.fused_ops else dict(self.fused_ops)

    def is_cache(self, source: str) -> bool:
        """Whether the input named `source` is part of the model's cache (`cache_inputs`)."""
        return source.startswith(self.cache_inputs) if self.cache_inputs else False

    @abc.abstractmethod
    def matches(self, param_fqns: Iterable[str], inputs: Iterable[str]) -> bool:
        """Whether a graph with these parameters and inputs is a model of this family."""

    @abc.abstractmethod
    def plan(self, options: BackendOptions) -> ShardingPlan:
        """The parameter placements, anchors and exits of `options.layout`."""

    @abc.abstractmethod
    def site(self, module_path: str) -> Site:
        """Where the module `module_path` (an FQN, "" for the root) sits."""

    @abc.abstractmethod
    def expected_collectives(self, options: BackendOptions) -> LayerCollectives:
        """The TP collectives of `options.layout` per decoder layer of the stock model (what
        `graph.py` counts a layer's others against)."""

    @abc.abstractmethod
    def check(self, options: BackendOptions, param_shapes: Mapping[str, Sequence[int]]) -> None:
        """Raise a ValueError that says what to change when `options` cannot shard a model
        with these parameter shapes (FQN -> shape); the passes would otherwise find out deep
        in the graph."""

    def check_inputs(self, inputs: Mapping[str, Any]) -> None:
        """Raise the model's own `ValueError` for a call it would refuse, from the inputs the
        compiled model is called with (model input name -> value; tensors carry their sizes):
        what the model checks itself but cannot while Dynamo traces (a comparison of sizes a
        marked token count leaves undecided). The front porch runs it on the inputs it compiles
        for, the program before every call, before any collective. The default: the token
        inputs have one length."""
        lengths = [
            (name, value.shape[0])
            for name in self.token_inputs
            if isinstance(value := inputs.get(name), torch.Tensor) and value.dim()
        ]
        if len({n for _, n in lengths}) > 1:
            raise ValueError(
                "the token inputs must have the same length T, got "
                + ", ".join(f"{name}={n}" for name, n in lengths)
            )

    def resolve(
        self, options: BackendOptions, params: Mapping[str, torch.Tensor]
    ) -> tuple[BackendOptions, dict[str, str]]:
        """`options` with every `"auto"` cut of the family's options decided for a model with
        these parameters (FQN -> example value: shapes and dtypes), and why: module FQN
        pattern -> the choice and the figures of its alternatives (shown where the cut's
        collectives are). A family without cuts has nothing to decide."""
        return options, {}

    def read_weights(
        self, path: str, weights: Sequence[WeightInput], *, skip_unimplemented_parts: bool
    ) -> tuple[list[torch.Tensor], dict[str, int]]:
        """The `checkpoint` option: each of `weights` read from the checkpoint at `path`, only
        its slice, as a CPU tensor of its dtype; and the bytes read per checkpoint tensor."""
        raise NotImplementedError(
            f"the {self.name} model family has no checkpoint reader: load the weights into the "
            "model instead of passing the checkpoint option"
        )

    def tp_advice(self, size: object) -> str:
        """What to change when tp does not divide a sharded dim of `size`."""
        return f"choose a tp that divides {self.tp_divides or size}"

    def planning_example(
        self, config: Any, *args: Any, **example: Any
    ) -> tuple[torch.nn.Module, tuple[Any, ...], tuple[torch.Tensor, ...]] | None:
        # (`*args: Any, **example: Any`: a family's override takes the arguments it accepts)
        """For `planning.plan_rank`: the model of `config` built on the meta device, the
        arguments of one example call (meta tensors; `example` says what the family accepts)
        and the token inputs among them; None when `config` is not a config of this family."""
        return None

    def table_lookup_op(self, op: object) -> TableLookup | None:
        return next((t for t in self.table_lookups if t.op is op), None)

    def routed_experts_op(self, op: object) -> RoutedExperts | None:
        return next((r for r in self.routed_experts if r.op is op), None)

    def innermost_site(self, module_paths: Sequence[str]) -> Site:
        """The site of the innermost of `module_paths` (outermost first)."""
        return self.site(module_paths[-1] if module_paths else "")
