"""The DeepSeek V4.1 family as the compiler sees it (`core.adapter.ModelAdapter`).

Module names are the model's (`deepseek_v41/model/model.py`): `embed`, decoder layers `layers.N` with the attention
half (`hc_attn`, `attn_norm`, `attn`) and the MoE half (`hc_ffn`, `ffn_norm`, `ffn`), then
`norm` and `head`. The routed experts are one custom op, `dsv41::routed_experts`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.fx import Node

from dsv41_compile.core.adapter import (
    ActivationRows,
    LayerCollectives,
    ModelAdapter,
    RoutedExperts,
    Site,
    TableLookup,
    WeightInput,
)
from dsv41_compile.core.placements import ColumnShard
from dsv41_compile.core.plan import ShardingPlan
from dsv41_compile.core.strategy import Strategy
from dsv41_compile.deepseek_v41.graph_mode import (
    act_quant_dequant_mx,
    engram_lookup_gathered,
    fp8_decode_rows_mx,
    fp8_encode_rows_mx,
    fp8_matmul,
    fp8_weight_decoded,
    routed_experts_fp4_grouped,
    routed_experts_grouped,
    sparse_attention_sfa,
)
from dsv41_compile.deepseek_v41.model import (
    DeepseekV41,
    ModelConfig,
    ops,  # noqa: F401  (registers the model's ops)
)
from dsv41_compile.deepseek_v41.model.attention import sparse_attention_aten
from dsv41_compile.deepseek_v41.model.batches import Request, pack
from dsv41_compile.deepseek_v41.model.checkpoint import read_weights
from dsv41_compile.deepseek_v41.model.numerics import fp8_rows_width
from dsv41_compile.deepseek_v41.model.ops import engram_dequantize
from dsv41_compile.deepseek_v41.model.quant import BLOCK
from dsv41_compile.deepseek_v41.model.validate import check_batch_shapes
from dsv41_compile.deepseek_v41.options import DeepseekV41Options
from dsv41_compile.deepseek_v41.plan import deepseek_v41_plan
from dsv41_compile.devices import timed_choice
from dsv41_compile.options import BackendOptions, Lowering
from dsv41_compile.spmd.rules.routed_experts import routed_experts_rule
from dsv41_compile.spmd.vocab import head_choice

__all__ = ["DEEPSEEK_V41", "DeepseekV41Adapter", "family_options"]

_LAYER = re.compile(r"^layers\.(\d+)(?:\.([^.]+))?")
_ATTENTION = ("hc_attn", "attn_norm", "attn")
_MOE = ("hc_ffn", "ffn_norm", "ffn")
_LAYER_PARTS = frozenset(("hc_attn", "attn", "hc_ffn", "ffn"))
"""What every decoder layer of the family has: attention and the MoE, each inside its mHC."""
ROUTED_EXPERTS = RoutedExperts(torch.ops.dsv41.routed_experts.default)
ROUTED_EXPERTS_FP4 = RoutedExperts(
    torch.ops.dsv41.routed_experts_fp4.default, n_weights=6, inputs_per_element=2, scaled=True
)
ENGRAM_LOOKUP = torch.ops.dsv41.engram_lookup.default
FP8_WEIGHT = torch.ops.dsv41.fp8_weight.default
SPARSE_ATTENTION = torch.ops.dsv41.sparse_attention.default
_SINK_ARG = 6  # `sink_H`, among the op's tensor arguments
ACT_QUANT = torch.ops.dsv41.act_quant_dequant.default


def act_quant_rule(node: Node, given: Sequence[Placement]) -> Strategy | None:
    """The official FP8 quantisation of an activation, in blocks of 32 along its last dim: where
    the value is, replicated or split along any dim (split along the last, each rank's part
    must be whole blocks: the op's shape check says so). Not a partial sum: quantising is not
    linear."""
    (x,) = given
    if isinstance(x, (Replicate, Shard)):
        return Strategy(inputs=(x,), outputs=(x,))
    return None


def fp8_weight_rule(node: Node, given: Sequence[Placement]) -> Strategy | None:
    """An FP8 weight held as released decodes where it is, with its block scales placed as it
    is: both replicated, or both split along one dim (in whole 32-wide blocks:
    `_check_fp8_shards`)."""
    weight, scale = given
    if weight == scale and isinstance(weight, (Replicate, Shard)):
        return Strategy(inputs=(weight, scale), outputs=(weight,))
    return None


def sparse_attention_rule(node: Node, given: Sequence[Placement]) -> Strategy | None:
    """Each query attends to KV rows of any token of its request and to the cache: the KV rows,
    the cache and the token inputs replicated; the queries split by heads (dim 1) with their
    sinks (dim 0), the output as the queries, or everything replicated."""
    q = given[0]
    heads: Placement
    sinks: Placement
    if q == Shard(1):
        heads, sinks = q, Shard(0)
    elif q == Replicate():
        heads = sinks = q
    else:
        return None
    inputs: list[Placement] = [Replicate()] * len(given)
    inputs[0], inputs[_SINK_ARG] = heads, sinks
    return Strategy(inputs=tuple(inputs), outputs=(heads,))


def _check_fp8_shards(plan: ShardingPlan, tp: int, params: Mapping[str, torch.Tensor]) -> None:
    """Each rank decodes its part of a split FP8 weight with the scales of its blocks: the
    part must be whole 32 x 32 blocks."""
    for fqn, value in params.items():
        if (
            value.dtype != torch.float8_e4m3fn
            or f"{fqn.removesuffix('.weight')}.scale" not in params
        ):
            continue
        placement = plan.param_placement(fqn)
        if isinstance(placement, Shard) and value.shape[placement.dim] % (BLOCK * tp):
            raise ValueError(
                f"weight_format='released': {fqn} {list(value.shape)} is split over tp={tp} "
                f"along dim {placement.dim}, {value.shape[placement.dim] // tp} per rank: not "
                f"whole {BLOCK}-wide blocks of its FP8 scales. Use a tp that splits it in whole "
                "blocks, or a model with weight_format='dequantized'"
            )


def engram_lookup_rule(node: Node, given: Sequence[Placement]) -> Strategy | None:
    """Replicated tables: each row is looked up where its token is (the rows' placement,
    token-sharded or replicated, is the output's). Tables split by columns: each rank asks for
    its token shard's rows (`tables.exchange` lowers it)."""
    table, scale, rows = given
    if table == scale == Replicate() and isinstance(rows, (Shard, Replicate)):
        return Strategy(inputs=(table, scale, rows), outputs=(rows,))
    if isinstance(table, ColumnShard) and table == scale:
        return Strategy(inputs=(table, scale, Shard(0)), outputs=(Shard(0),))
    return None


ENGRAM = TableLookup(ENGRAM_LOOKUP, engram_dequantize)


def family_options(options: BackendOptions) -> DeepseekV41Options:
    """The DeepSeek V4.1 options among `options` (`families.options_for` made them so)."""
    family = options.family
    if not isinstance(family, DeepseekV41Options):
        raise TypeError(
            f"{type(family).__name__} where DeepseekV41Options are needed: pass the options "
            "through families.options_for(options, DEEPSEEK_V41)"
        )
    return family


def _with(options: BackendOptions, **family: str) -> BackendOptions:
    """`options` with these DeepSeek V4.1 options replaced."""
    return dataclasses.replace(
        options, family=dataclasses.replace(family_options(options), **family)
    )


_REQUESTS = (Request(0, [1, 2, 3], 0), Request(1, [4, 5], 0))
"""`plan_rank`'s example batch: two requests of 3 and 2 tokens."""


def _resolve_head(
    options: BackendOptions, params: Mapping[str, torch.Tensor]
) -> tuple[BackendOptions, dict[str, str]]:
    """Replicated or vocab-sharded over tp: the generic choice (`spmd.vocab.head_choice`) for
    the fp32 head `head.weight` and the option `head`."""
    given = family_options(options).head
    chosen, why = head_choice("head", given, params.get("head.weight"), options)
    return _with(options, head=chosen), why


ENGRAM_REPLICATED_LIMIT = 1 << 30
"""`engram="auto"` replicates the Engram tables when they take at most this many bytes per
rank (and fit `extra_weight_bytes`). By time replicated tables always win (a lookup reads
only the rows asked for; split tables add the step's exchange), so the split is memory's
choice; the released tables take 203 GB."""


def _resolve_engram(
    options: BackendOptions, params: Mapping[str, torch.Tensor]
) -> tuple[BackendOptions, dict[str, str]]:
    """Replicated or split by columns over the world (in device or host memory): per rank, the
    replicated tables' bytes against about a world-th of them; per token and Engram layer, the
    sharded exchange's bytes (each of its C row ids, 8 B, out to the rank of its column, the
    row and its scales back, (world-1)/world of them leaving the rank). Estimates: a rank holds
    its columns' rows padded to the longest range, and C not a multiple of the world pads the
    exchange (the graph's bytes are the accounting's, `report.accounting`)."""
    given = family_options(options).engram
    tables = {f: v for f, v in params.items() if f.endswith(".engram.embed.weight")}
    if not tables:
        return _with(options, engram="replicated"), {}
    scales = [v for f, v in params.items() if f.endswith(".engram.embed.scale")]
    row = next(iter(tables.values())).shape[1] + scales[0].shape[1]  # bytes: codes + scales
    replicated = sum(v.shape[0] for v in tables.values()) * row
    world = options.ep
    sharded = sum(-(-v.shape[0] // world) for v in tables.values()) * row
    wkv = next(v for f, v in params.items() if f.endswith(".engram.wkv.weight"))
    columns = wkv.shape[1] // next(iter(tables.values())).shape[1]
    exchange = (world - 1) / world * columns * (8 + row)
    # the step's one exchange (`tables`) on the device model at `rows_per_step`: two
    # all-to-alls, each rank's tokens' ids out and rows back for every table
    device = options.device_model(next(iter(tables.values())).device.type)
    per_rank = -(-options.rows_per_step // options.tp) * exchange * len(tables)
    seconds = device.collective_seconds(per_rank, count=2, group=world, all_to_all=True)
    timed = (
        f"{seconds * 1e6:.1f} us per step for the exchange on {device.name} at "
        f"{options.rows_per_step} rows per step"
    )
    chosen, can_shard = given, world > 1 and options.layout == "sp"
    limit = ENGRAM_REPLICATED_LIMIT
    if options.extra_weight_bytes is not None:
        limit = min(limit, options.extra_weight_bytes)
    if chosen == "auto":
        chosen = "sharded" if can_shard and replicated > limit else "replicated"
    elif chosen != "replicated" and not can_shard:
        raise ValueError(
            f"engram={chosen!r} splits the Engram tables over the world, which the EP group "
            f"is: it needs ep = the world size and layout='sp' (got ep={world}, "
            f"layout={options.layout!r}); use engram='replicated'"
        )
    if chosen == "replicated":
        why = f"engram={given!r}: replicated, {replicated:,} B of tables per rank"
        if can_shard:
            why += f" against {sharded:,} B split over {world} ranks and {timed}"
        why += "; no exchange"
    else:
        where = " in host memory" if chosen == "host" else ""
        over = f" (over {limit:,} B)" if given == "auto" else ""
        why = (
            f"engram={given!r}: {chosen}, about {sharded:,} B of tables per rank{where} "
            f"against {replicated:,} B replicated{over}; about {exchange:,.0f} B per token and "
            f"Engram layer exchanged, {timed}"
        )
    return _with(options, engram=chosen), {"layers.*.engram": why}


def _resolve_shared_expert(
    options: BackendOptions, params: Mapping[str, torch.Tensor]
) -> tuple[BackendOptions, dict[str, str]]:
    """Whole on every rank or split over tp, by the time each adds to a layer on the device
    model at `rows_per_step` rows R: whole, the roofline of reading its three weights and
    their matmuls on the rank's ceil(R/tp) rows; split, 1/tp of the weights and matmuls on all
    R rows, an AllGather of the `[R, D]` input and a ReduceScatter of the `[R, D]` partial
    output in the activation dtype (a latency each, (tp-1)/tp of the rows' bytes leaving the
    rank). The matmuls run at the weights' rate (FP8 as released). The layers' shared experts
    have one shape: one choice for all."""
    given = family_options(options).shared_expert
    w1 = [v for f, v in params.items() if f.endswith(".ffn.shared_expert.w1.weight")]
    if options.layout != "sp" or options.tp == 1 or not w1:  # nothing to split
        if given == "split":
            raise ValueError(
                f"shared_expert='split' splits the shared expert over tp in the sp layout "
                f"(got layout={options.layout!r}, tp={options.tp}); use shared_expert='auto'"
            )
        return _with(options, shared_expert="whole"), {}
    tp, (hidden, dim) = options.tp, w1[0].shape
    act = params["embed.weight"].dtype
    if act != torch.float32:
        if given == "split":
            raise ValueError(
                f"shared_expert='split': the split expert's w2 gives each rank a partial sum in "
                f"the activation dtype ({act}), whose rounding before the sum differs from the "
                "single-device model's; the split needs fp32 activations. Use "
                "shared_expert='whole'"
            )
        return _with(options, shared_expert="whole"), {
            "layers.*.ffn.shared_expert": f"shared_expert={given!r}: whole ({act} activations: "
            "a split expert's partial sums would round on each rank)"
        }
    weight = 3 * w1[0].numel() * w1[0].element_size()
    operand = "fp8" if w1[0].element_size() == 1 else "bf16"
    device = options.device_model(w1[0].device.type)
    rows = options.rows_per_step
    moved = (tp - 1) / tp * rows * dim * act.itemsize
    seconds = {
        "whole": device.roofline_seconds(weight, 6 * -(-rows // tp) * dim * hidden, operand),
        "split": device.roofline_seconds(weight / tp, 6 * rows * dim * hidden / tp, operand)
        + device.collective_seconds(2 * moved, count=2, group=tp),
    }
    chosen = min(seconds, key=seconds.__getitem__) if given == "auto" else given
    why = timed_choice("shared_expert", given, chosen, seconds, "layer", 1, device.name, rows) + (
        f" ({weight:,} B of weights per layer whole, {weight // tp:,} B per rank split; split "
        f"gathers its input and reduce-scatters its output, {moved:,.0f} B each per rank)"
    )
    return _with(options, shared_expert=chosen), {"layers.*.ffn.shared_expert": why}


class DeepseekV41Adapter(ModelAdapter):
    name = "deepseek_v41"
    options = DeepseekV41Options
    token_inputs = ("input_ids", "positions", "slots")
    layouts = ("sp", "replicated")
    whole_model_modules = ("embed", "head")
    routed_experts = (ROUTED_EXPERTS, ROUTED_EXPERTS_FP4)
    table_lookups = (ENGRAM,)
    rules = {
        ROUTED_EXPERTS.op: routed_experts_rule(ROUTED_EXPERTS),
        ROUTED_EXPERTS_FP4.op: routed_experts_rule(ROUTED_EXPERTS_FP4),
        FP8_WEIGHT: fp8_weight_rule,
        ACT_QUANT: act_quant_rule,
        ENGRAM_LOOKUP: engram_lookup_rule,
        SPARSE_ATTENTION: sparse_attention_rule,
    }
    fused_ops = {SPARSE_ATTENTION: sparse_attention_aten}
    graph_mode_rewrites = {
        ROUTED_EXPERTS.op: routed_experts_grouped,
        ROUTED_EXPERTS_FP4.op: routed_experts_fp4_grouped,
        FP8_WEIGHT: fp8_weight_decoded,
        ACT_QUANT: act_quant_dequant_mx,
        torch.ops.dsv41.fp8_encode_rows.default: fp8_encode_rows_mx,
        torch.ops.dsv41.fp8_decode_rows.default: fp8_decode_rows_mx,
        torch.ops.aten.mm.default: fp8_matmul,
        ENGRAM_LOOKUP: engram_lookup_gathered,
        SPARSE_ATTENTION: sparse_attention_sfa,
    }
    activation_rows = ActivationRows(
        quantize=ACT_QUANT,
        encode=torch.ops.dsv41.fp8_encode_rows.default,
        decode=torch.ops.dsv41.fp8_decode_rows.default,
        width=fp8_rows_width,
        block=BLOCK,
        name="FP8",
    )
    tp_divides = "n_heads and o_groups"
    cache_inputs = ("cache.",)

    def decomposed(self, options: BackendOptions, lowering: Lowering) -> dict[Any, Any]:
        """The generic choice, and the attention as the model computes it wherever
        `npu_attention="gathered"`."""
        decomposed = super().decomposed(options, lowering)
        if family_options(options).npu_attention == "gathered":
            decomposed[SPARSE_ATTENTION] = sparse_attention_aten
        return decomposed

    def matches(self, param_fqns: Iterable[str], inputs: Iterable[str]) -> bool:
        """By the structure of its parameters: decoder layers `layers.N`, each with its
        attention and MoE halves inside their mHC (`_LAYER_PARTS`), whatever else an edit adds;
        or, without layers, the embedding or the head (a piece of the model, cut by a graph
        break: capture refuses it as such)."""
        fqns = list(param_fqns)
        parts: dict[str, set[str]] = {}
        for fqn in fqns:
            match = _LAYER.match(fqn)
            if match is not None and match.group(2) is not None:
                parts.setdefault(match.group(1), set()).add(match.group(2))
        if parts:
            return all(found >= _LAYER_PARTS for found in parts.values())
        return "embed.weight" in fqns or "head.weight" in fqns

    def check_inputs(self, inputs: Mapping[str, Any]) -> None:
        """The forward's own check of its batch (`check_batch_shapes`: dims, dtypes, lengths),
        with its messages."""
        ids, positions, slots = (inputs.get(name) for name in self.token_inputs)
        if (
            isinstance(ids, torch.Tensor)
            and isinstance(positions, torch.Tensor)
            and isinstance(slots, torch.Tensor)
        ):
            check_batch_shapes(ids, positions, slots, inputs.get("logit_rows"))

    def plan(self, options: BackendOptions) -> ShardingPlan:
        family = family_options(options)
        return deepseek_v41_plan(
            embedding=family.embedding,
            ep=options.ep,
            layout=options.layout,
            attn_exit=family.attn_exit,
            attn_entry=family.attn_entry,
            engram=family.engram,
            head=family.head,
            shared_expert=family.shared_expert,
        )

    def resolve(
        self, options: BackendOptions, params: Mapping[str, torch.Tensor]
    ) -> tuple[BackendOptions, dict[str, str]]:
        """The attention exit (`_resolve_attn_exit`), how the head is held (`_resolve_head`),
        where the Engram tables live (`_resolve_engram`) and how the shared expert is held
        (`_resolve_shared_expert`), decided for a model with these parameters."""
        options, exit_why = self._resolve_attn_exit(options, params)
        options, head_why = _resolve_head(options, params)
        options, engram_why = _resolve_engram(options, params)
        options, shared_why = _resolve_shared_expert(options, params)
        _check_fp8_shards(self.plan(options), options.tp, params)
        return options, {**exit_why, **head_why, **engram_why, **shared_why}

    def _resolve_attn_exit(
        self, options: BackendOptions, params: Mapping[str, torch.Tensor]
    ) -> tuple[BackendOptions, dict[str, str]]:
        """The attention exit, by the time it adds to a layer's step on the device model
        (`BackendOptions.device`) at `rows_per_step` rows: one collective's latency, its bytes
        over the link -- per token and rank, the ReduceScatter of the fp32 `[T, D]` partial
        moves (tp-1)/tp * 4D bytes, the all-to-all of `wo_a`'s output groups (tp-1)/tp *
        G*o_lora/tp activation bytes -- and for the all-to-all, which holds `wo_b` (D x G*o_lora
        per layer) whole on every TP rank, the (tp-1)/tp of it read beyond the rank's shard.
        The layers' `wo_b` have one shape: one choice for all."""
        wo_b = [v for fqn, v in params.items() if fqn.endswith(".attn.wo_b.weight")]
        if options.layout != "sp" or options.tp == 1 or not wo_b:  # nothing to cut
            return _with(options, attn_exit="reduce_scatter", attn_entry="input"), {}
        # the activations are in the embedding's dtype (wo_b may be held as FP8 codes)
        tp, (dim, width), act = options.tp, wo_b[0].shape, params["embed.weight"].element_size()
        wire = {  # ring collectives: (tp-1)/tp of each token's row leaves the rank
            "reduce_scatter": (tp - 1) / tp * dim * 4,
            "all_to_all": (tp - 1) / tp * (width // tp) * act,
        }
        layer_extra = wo_b[0].numel() * wo_b[0].element_size() * (tp - 1) // tp
        device = options.device_model(wo_b[0].device.type)
        rows = options.rows_per_step
        seconds = {
            cut: device.collective_seconds(
                rows * wire[cut], group=tp, all_to_all=cut != "reduce_scatter"
            )
            for cut in wire
        }
        seconds["all_to_all"] += layer_extra / device.hbm_bytes_per_s
        extra = layer_extra * len(wo_b)
        budget = options.extra_weight_bytes
        fits = budget is None or extra <= budget
        given = family_options(options).attn_exit
        chosen = given
        if chosen == "auto":
            faster = min(seconds, key=seconds.__getitem__)
            chosen = faster if fits else "reduce_scatter"
        elif chosen == "all_to_all" and not fits:
            raise ValueError(
                f"attn_exit='all_to_all' replicates wo_b on every TP rank: {extra:,} more bytes "
                f"of weights per rank than extra_weight_bytes={budget:,} allows; raise the "
                "budget or use attn_exit='reduce_scatter'"
            )
        (other,) = set(seconds) - {chosen}
        why = timed_choice("attn_exit", given, chosen, seconds, "layer", 3, device.name, rows)
        why += (
            f" ({device.collective_latency * 1e6:.0f} us per collective; "
            f"{wire[chosen]:,.0f} B per token against {wire[other]:,.0f} B"
        )
        if chosen == "all_to_all":
            why += f"; wo_b replicated: +{extra:,} B of weights per rank)"
        else:
            why += f"; all_to_all would read +{layer_extra:,} B of wo_b per layer)"
            if not fits:
                why += f" (all_to_all would replicate {extra:,} B > extra_weight_bytes)"
        # where the exit's collective runs: entering wo_b, or at the layer's residual add
        region = "layers.*.attn.wo_b" if chosen == "all_to_all" else "layers.*"
        return _with(options, attn_exit=chosen), {region: why}

    def site(self, module_path: str) -> Site:
        match = _LAYER.match(module_path)
        if match is None:
            top = module_path.split(".")[0]
            part = "entry" if top == "embed" else "exit" if top in ("norm", "head") else ""
            return Site(None, part)
        layer, child = int(match.group(1)), match.group(2)
        if child in _ATTENTION:
            return Site(layer, "attention")
        if child in _MOE:
            return Site(layer, "moe")
        return Site(layer, "layer")

    def check(self, options: BackendOptions, param_shapes: Mapping[str, Sequence[int]]) -> None:
        if family_options(options).attn_exit == "all_to_all" and options.layout != "sp":
            raise ValueError(
                f"attn_exit='all_to_all' is a cut of the sp layout; layout={options.layout!r} "
                "all-reduces attention's output (use attn_exit='auto' or 'reduce_scatter')"
            )
        # Attention shards its heads and output groups over tp (the plan): read H and G from
        # layer 0's weights -- sink [H], wq_b [H*d, q_lora], wo_a [G*o_lora, H/G*d].
        sink = param_shapes.get("layers.0.attn.attn_sink")
        if sink is None:
            return
        heads = sink[0]
        head_dim = param_shapes["layers.0.attn.wq_b.weight"][0] // heads
        groups = heads * head_dim // param_shapes["layers.0.attn.wo_a.weight"][1]
        tp = options.tp
        if heads % tp or groups % tp:
            fits = [t for t in range(1, heads + 1) if heads % t == 0 and groups % t == 0]
            raise ValueError(
                f"tp={tp} does not divide this model's attention: it shards its {heads} heads "
                f"and {groups} output groups over tp; choose tp in {fits}"
            )

    def planning_example(
        self,
        config: Any,
        *,
        requests: Sequence[Request] = _REQUESTS,
        max_len: int = 64,
        program: str = "backbone",
    ) -> tuple[torch.nn.Module, tuple[Any, ...], tuple[torch.Tensor, ...]] | None:
        """A meta model of `config`, a batch of `requests` (one slot each) and a cache of
        `max_len` positions per request. `program`: "backbone" (the model's call), "verify"
        (the call that also returns what the DSpark drafter reads, `hidden=True`) or "drafter"
        (`model.mtp`'s call: a draft block after each request, the requests' positions as
        context; T counts the blocks' rows, the context rows are the example's)."""
        if not isinstance(config, ModelConfig):
            return None
        if program not in ("backbone", "verify", "drafter"):
            raise ValueError(f"program={program!r}: 'backbone', 'verify' or 'drafter'")
        if program != "backbone" and not config.num_nextn_predict_layers:
            raise ValueError(f"program={program!r}: the config has no DSpark stages")
        with torch.device("meta"):
            model = DeepseekV41(config)
            cache = model.new_cache(num_slots=len(requests), max_len=max_len)
        ids, positions, slots = (t.to("meta") for t in pack(list(requests)))
        if program == "backbone":
            return model, (ids, positions, slots, cache), (ids, positions, slots)
        if program == "verify":
            return model, (ids, positions, slots, cache, True), (ids, positions, slots)
        noise = [config.dspark_noise_token_id] * (config.dspark_block_size - 1)
        blocks = [Request(r.slot, [1, *noise], r.start + len(r.ids)) for r in requests]
        block_ids, block_positions, block_slots = (t.to("meta") for t in pack(blocks))
        width = config.dim * len(config.dspark_target_layer_ids)
        with torch.device("meta"):
            draft_cache = model.mtp.new_cache(len(requests))
            hidden = torch.zeros(ids.shape[0], width, dtype=config.torch_dtype)
        context = (hidden, positions, slots)
        block = (block_ids, block_positions, block_slots)
        # the context rows keep the example's count: a plan's costs are functions of T alone
        return model.mtp, (*block, draft_cache, *context), block

    def read_weights(
        self, path: str, weights: Sequence[WeightInput], *, skip_unimplemented_parts: bool
    ) -> tuple[list[torch.Tensor], dict[str, int]]:
        if any(w.fqn.startswith("main_proj.") for w in weights):  # the DSpark drafter's program
            raise NotImplementedError(
                "the checkpoint option reads the backbone's weights; the DSpark drafter "
                "(model.mtp) compiled on its own is not read from a checkpoint per rank: load "
                "the model with load_checkpoint(model, DIR) and compile model.mtp without the "
                "checkpoint option"
            )
        return read_weights(path, weights, skip_unimplemented_parts=skip_unimplemented_parts)

    def expected_collectives(self, options: BackendOptions) -> LayerCollectives:
        if options.layout == "sp":
            # The normed [Tl, D] attention input gathered (not the [Tl, n, D] residual), the
            # fp32 wo_b partial reduce-scattered, or wo_b's input moved to its tokens' ranks
            # (attn_exit); the MoE half talks over ep only.
            exit_cut = family_options(options).attn_exit
            out = "all_to_all" if exit_cut == "all_to_all" else "reduce_scatter"
            # a split shared expert: its input gathered, its partial output reduce-scattered
            split = family_options(options).shared_expert == "split"
            return LayerCollectives(("all_gather", out), ("all_gather", "reduce_scatter") * split)
        # The baseline: the wo_b partial all-reduced; with experts sharded, the owners' MoE
        # output all-gathered back to the TP group.
        return LayerCollectives(("all_reduce",), ("all_gather",) if options.ep > 1 else ())


DEEPSEEK_V41 = DeepseekV41Adapter()
