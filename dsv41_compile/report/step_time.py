"""What one rank's step would take on a device, read from its rewritten per-rank graph (the
graph handed to the target), beside the two floors it is measured against.

The model, a roofline per kernel of the program as lowered (not of an ideal one):

- Each op is a kernel: it reads its inputs from device memory, writes its output, and takes
  the roofline of the two, `max(bytes / HBM bandwidth, FLOPs / peak rate)`. Sizes are formulas
  in T, the DP group's token count, as in `report.accounting` (whose substitutions and FLOPs
  this uses). Except:
  - a view (reshape, slice, permute, expand, ...), a `getitem` and a size read cost nothing:
    their readers read what they alias;
  - pointwise ops (torch's `pointwise` tag) fuse, as a compiler fuses them: one reads only the
    inputs no pointwise op made, and writes its output only where something other than a
    pointwise op reads it, or the graph returns it;
  - a gather (`index`, `index_select`, `gather`, `embedding`) reads the rows it selects (its
    output's bytes) and its index, not its whole source;
  - torch_npu's sparse flash attention reads its operands once (its queries, its KV source,
    the index lists) and computes `4 D` FLOPs per query head and listed key: the rows the lists
    name are taken to be read from device memory once, the kernel keeping a row for the
    queries that name it (an assumption: each query reading its rows anew would add its
    `T x keys x D` bytes);
  - each weight is read once per step, by its first reader;
  - an EP layer costs what its busiest rank does (an EP step waits for it): its routed-experts
    op -- or torch_npu's grouped matmul of the rank's stacked experts -- reads the experts the
    step's rows touch on that rank and computes the assignments it receives (FLOPs per
    assignment times their count, not its buffer's rows): under uniform routing the expected
    maximum over the ranks of each (`EpLoad.expected_busiest`; each of the rank's experts
    touched with probability `1 - (1 - K/E)^R`, `R` the rows of the whole world, each of the
    `R K` assignments on the rank with probability `1/ep`), or a given routing's
    (`Scenario.ep_load`, `EpLoad.of_routing`). Without EP each rank computes its own DP
    group's rows.
- A collective takes a latency (an assumption: `devices.LATENCIES`) plus the larger of the bytes
  it sends and receives over one rank's link (`report.comm.collective_bytes`): the node's link
  within a node, the link between nodes for the share that crosses them
  (`Device.collective_seconds`; a node is `Device.ranks_per_node` consecutive ranks).
- The step is the sum: the program runs one op after another (no overlap is modelled).

The floors:

- the layout's, in HBM time at the same bandwidth: each byte this rank's placement makes the
  step read, once: the weights it holds (its experts as its busiest rank touches them) and the
  cache the step reads;
- the layout's compute floor: the FLOPs of its matmuls at the device's peak rates, the dense
  ones at the step's rows, the experts at the busiest rank's assignments (a prefill is bound
  by it, not by HBM); a lowering is measured against the larger of the two, plus its
  collectives;
- the physical one, in HBM time: each weight the step needs read once across the world (the
  experts touched by the world's rows, on average), the cache once per DP group (its TP ranks
  share it), over the world's ranks; plus the rows this rank gathers of a weight (the embedding's), which no other rank
  reads for it. Every DP group is taken as busy as this rank's.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import sympy
import torch
from torch.fx import GraphModule, Node

from dsv41_compile.core.collectives import collective_kind
from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.meta import GLOBAL_VAL, module_paths
from dsv41_compile.core.symbols import T
from dsv41_compile.devices import Device
from dsv41_compile.report.accounting import (
    NPU_GROUPED_MATMUL,
    NPU_QUANT_MATMUL,
    NPU_SPARSE_FLASH_ATTENTION,
    assignment_flops,
    ep_layer_of,
    in_t,
    node_flops,
    rank_inputs,
    sizes_in_t,
    symbolic_size,
)
from dsv41_compile.report.comm import collective_bytes

__all__ = [
    "EpLoad",
    "LayerTime",
    "OpCost",
    "Scenario",
    "StepCosts",
    "StepTime",
    "step_costs",
    "step_time",
]

aten = torch.ops.aten

_VIEWS = {
    aten.view.default,
    aten.view.dtype,  # the same bytes read as another dtype (FP4 codes as uint8, FP8 rows)
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.expand.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.alias.default,
    aten.detach.default,
    aten.as_strided.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unbind.int,
    aten.view_as_real.default,
    aten.view_as_complex.default,
    aten.unflatten.int,
    aten.flatten.using_ints,
}
_GATHERS = {
    aten.index.Tensor,
    aten.index_select.default,
    aten.gather.default,
    aten.embedding.default,
}
_FREE = {torch.ops._c10d_functional.wait_tensor.default, aten.sym_size.int, aten.sym_numel.default}
"""Nodes that are no kernel: a collective's wait (the collective is costed), size reads."""
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
_NPU_MATMULS = (NPU_GROUPED_MATMUL, NPU_QUANT_MATMUL, NPU_SPARSE_FLASH_ATTENTION)  # by name


@dataclass(frozen=True)
class OpCost:
    """One kernel or collective of the per-rank graph. Byte and FLOP counts are formulas in T;
    `expert_bytes` are the bytes of all the experts a routed-experts op holds, read at the
    touched fraction (`StepCosts.touched`)."""

    node: str
    layer: int | None
    kind: str
    """"matmul", "experts", "gather", "pointwise", "other" or a collective's
    "<kind>(<axis>)"."""
    read: sympy.Expr
    written: sympy.Expr
    flops: sympy.Expr
    operand: str = "bf16"
    """The matmul rate this op's FLOPs run at (`devices.MATMUL_DTYPES`)."""
    wire: sympy.Expr = sympy.Integer(0)
    """A collective's bytes over the link: the larger of sent and received."""
    group: int = 1
    """A collective's group size (consecutive ranks: the TP group, or the world for EP)."""
    expert_bytes: sympy.Expr = sympy.Integer(0)
    weight_bytes: sympy.Expr = sympy.Integer(0)
    """Of `read`, the bytes of weights (read once per step, here)."""
    cache_bytes: sympy.Expr = sympy.Integer(0)
    """Of `read`, the bytes of the model's cache inputs."""
    assignment_flops: sympy.Expr = sympy.Integer(0)
    """An "experts" op's FLOPs per (row, expert) assignment it computes: its FLOPs are that
    times the assignments the rank receives (`EpLoad`), not its buffer's rows (a padded
    buffer's empty rows and a grouped matmul's rows past its groups are not computed)."""

    @property
    def collective(self) -> bool:
        return "(" in self.kind


@dataclass(frozen=True)
class StepCosts:
    """What `step_time` needs of one planned rank: its ops and the sizes of the floors."""

    ops: tuple[OpCost, ...]
    world_size: int
    tp: int
    experts: int
    """E: the routed experts of a MoE layer (0: none)."""
    top_k: int
    global_weight_bytes: int
    """Every weight of the model once (the experts' at all E), the floor's numerator."""
    global_expert_bytes: int
    """Of `global_weight_bytes`, the routed experts'."""
    layers: int
    """The decoder layers the ops belong to."""
    cache_bytes_per_request: float = 0.0
    """One request's cache on this rank (one slot of every cache tensor), at the cache length
    the graph was planned with."""
    held_weights: dict[str, int] = field(default_factory=dict)
    """The weights this rank holds in device memory (its shards, the replicated ones whole;
    not the tables it keeps in host memory), bytes per held tensor, keyed by the parameter and
    the part of it held (`"<fqn>"` whole, `"<fqn>[dim/parts...]"` a shard): two programs of one
    rank that hold the same key share it where they read their weights from one checkpoint
    (`runtime.weights`)."""

    @property
    def held_weight_bytes(self) -> int:
        return sum(self.held_weights.values())

    def requests_that_fit(self, hbm_bytes: float, also_held: int = 0) -> int:
        """The requests whose cache fits in `hbm_bytes` beside the held weights and
        `also_held` bytes more (another program's weights; activations and the runtime's own
        memory not counted)."""
        if not self.cache_bytes_per_request:
            return 0
        free = hbm_bytes - self.held_weight_bytes - also_held
        return max(0, int(free // self.cache_bytes_per_request))

    ep: int = 1
    """The ranks a MoE layer's experts are spread over (1: every rank holds every expert)."""

    def touched(self, world_rows: int) -> float:
        """The expected fraction of a layer's experts the world's rows touch (uniform routing,
        each row K distinct experts of E)."""
        if not self.experts:
            return 0.0
        return 1.0 - (1.0 - self.top_k / self.experts) ** world_rows

    def busiest(self, world_rows: int, rows: int) -> EpLoad:
        """The expected load of the busiest rank of an EP layer under uniform routing: the
        expected maximum over the `ep` ranks of the experts the world's rows touch and of the
        assignments it receives (`EpLoad.expected_busiest`); without EP (`ep` = 1), its own
        DP group's `rows`, each rank computing them all."""
        if self.ep <= 1:
            return EpLoad.expected_busiest(self.experts, self.top_k, 1, rows)
        return EpLoad.expected_busiest(self.experts, self.top_k, self.ep, world_rows)


@dataclass(frozen=True)
class EpLoad:
    """One rank's share of an EP layer's work in a step: of the `held` experts it holds, how
    many the step's rows touch (each read once), and how many (row, expert) assignments it
    computes. An EP step waits for its busiest rank: the step-time model costs every EP layer
    at it (`Scenario.ep_load`, or the expectation under uniform routing)."""

    held: int
    touched: float
    assignments: float

    @property
    def fraction(self) -> float:
        """Of the rank's experts' bytes, the share read."""
        return self.touched / self.held if self.held else 0.0

    @staticmethod
    def expected_busiest(experts: int, top_k: int, ep: int, world_rows: int) -> EpLoad:
        """The expected maximum over `ep` ranks of `experts / ep` each, under uniform routing
        of `world_rows` rows to `top_k` distinct experts: a rank's touched experts taken as
        binomial (each of its experts touched with the probability `1 - (1 - K/E)^R`) and its
        assignments as binomial (`R K` assignments, each on the rank with probability `1/ep`),
        the ranks as independent; the expected maximum of each by its distribution, `sum_k
        P(max >= k)`."""
        if not experts:
            return EpLoad(0, 0.0, 0.0)
        held = experts // max(ep, 1)
        p_touched = 1.0 - (1.0 - top_k / experts) ** world_rows
        touched = _expected_max_binomial(held, p_touched, ep)
        assignments = _expected_max_binomial(world_rows * top_k, 1.0 / max(ep, 1), ep)
        return EpLoad(held, touched, assignments)

    @staticmethod
    def of_routing(topk_idx: Sequence[Sequence[int]], experts: int, ep: int) -> list[EpLoad]:
        """Each rank's load for a given routing: `topk_idx` the experts of each of the world's
        rows (-1: none), expert e on rank `e // (experts / ep)`."""
        held = experts // ep
        touched: list[set[int]] = [set() for _ in range(ep)]
        assignments = [0] * ep
        for row in topk_idx:
            for e in row:
                if e >= 0:
                    touched[e // held].add(e)
                    assignments[e // held] += 1
        return [EpLoad(held, len(t), a) for t, a in zip(touched, assignments)]


def _expected_max_binomial(n: int, p: float, ranks: int) -> float:
    """E[max of `ranks` independent Binomial(n, p)] = sum over k >= 1 of 1 - P(X < k)^ranks
    (a normal approximation's terms past n = 4096 trials: the CDF by `math.erf`)."""
    if n <= 0 or p <= 0.0:
        return 0.0
    if ranks <= 1:
        return n * p
    if n > 4096:
        mean, sd = n * p, math.sqrt(n * p * (1 - p))
        if sd == 0.0:
            return mean

        def cdf(k: int) -> float:  # P(X < k), continuity-corrected
            return 0.5 * (1 + math.erf((k - 0.5 - mean) / (sd * math.sqrt(2))))

        lo, hi = max(1, int(mean - 10 * sd)), min(n, int(mean + 10 * sd) + 1)
        return (lo - 1) + sum(1.0 - cdf(k) ** ranks for k in range(lo, hi + 1))
    total, below, term = 0.0, 0.0, (1.0 - p) ** n  # term: P(X = k), from k = 0
    for k in range(1, n + 1):
        below += term  # P(X < k)
        total += 1.0 - below**ranks
        if below > 1.0 - 1e-15:
            break
        term *= (n - k + 1) / k * p / (1.0 - p) if p < 1.0 else 0.0
    return total


@dataclass(frozen=True)
class Scenario:
    """A step: `rows` tokens in this rank's DP group (T), `world_rows` over every DP group
    (the rows the routed experts see)."""

    name: str
    rows: int
    world_rows: int
    ep_load: EpLoad | None = None
    """The busiest rank's EP load, for a routing of one's own; None: the expectation under
    uniform routing (`StepCosts.busiest`)."""


@dataclass(frozen=True)
class LayerTime:
    """One decoder layer's part of a step (or, under layer None, what is outside the layers:
    the embedding, the head): its predicted seconds, collectives included, and its share of
    the two floors."""

    seconds: float
    layout_floor: float
    """Its weights, cache and touched experts read once, at the device's HBM rate."""
    compute_floor: float
    """Its matmuls' and experts' FLOPs at the device's rates."""


@dataclass
class StepTime:
    """One scenario's prediction (seconds) on one device."""

    scenario: Scenario
    device: Device
    seconds: float
    hbm_seconds: float
    compute_seconds: float
    collective_seconds: float
    collectives: int
    layer_collectives: int
    """Of `collectives`, those inside the decoder layers."""
    hbm_bytes: float
    layout_floor: float
    physical_floor: float
    compute_floor: float = 0.0
    """The FLOPs of the layout's matmuls at the device's rates: its dense matmuls at the
    step's rows, its experts at the busiest rank's assignments."""
    ops: list[tuple[float, OpCost]] = field(default_factory=list)
    """Each op's seconds, in graph order."""
    layers: dict[int | None, LayerTime] = field(default_factory=dict)
    """Per decoder layer (None: outside the layers), in graph order of first appearance."""

    @property
    def floor(self) -> float:
        """The larger of the layout's HBM floor and its compute floor."""
        return max(self.layout_floor, self.compute_floor)

    def top(self, n: int, *, collectives: bool) -> list[tuple[float, OpCost]]:
        chosen = [(s, op) for s, op in self.ops if op.collective == collectives]
        return sorted(chosen, key=lambda x: -x[0])[:n]


def step_costs(gm: GraphModule, ctx: CompileContext) -> StepCosts:
    """The costs of the rewritten per-rank graph `gm` (see the module docstring)."""
    names = sizes_in_t(gm, ctx)
    weights = set(ctx.param_fqns)
    caches = {n for n, s in ctx.input_sources.items() if ctx.adapter.is_cache(s)}
    origin: dict[Node, Node] = {}  # a view -> the placeholder or node it aliases
    paid: set[Node] = set()  # weights read already
    ops: list[OpCost] = []
    experts, top_k, ep = 0, 0, 1
    zero = sympy.Integer(0)

    def root(n: Node) -> Node:
        return origin.get(n, n)

    def nbytes(value: object) -> sympy.Expr:
        if not isinstance(value, torch.Tensor):
            return zero
        numel = sympy.Mul(*(symbolic_size(s) for s in value.shape))
        return sympy.sympify(numel * value.element_size()).xreplace(names)

    def reads(node: Node, args: list[Node]) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr]:
        """(bytes, of which weights, of which cache) `node` reads of `args`."""
        total = weight = cache = zero
        for arg in args:
            source = root(arg)
            size = nbytes(arg.meta.get("val"))
            if source.op == "placeholder" and source.name in weights:
                if source not in paid:  # a weight is read once per step
                    paid.add(source)
                    weight += nbytes(source.meta.get("val"))
                continue
            if source.op == "placeholder" and source.name in caches:
                cache += size
            elif node in pointwise and source in pointwise:
                continue  # fused: the producer's value never left the kernel
            total += size
        return total + weight, weight, cache

    def experts_op(
        node: Node,
        read: sympy.Expr,
        val: torch.Tensor,
        operand: str,
        expert_bytes: sympy.Expr,
        per_row: sympy.Expr,
    ) -> OpCost:
        """An op of a rank's stacked experts: their bytes read at the touched fraction, its
        FLOPs per assignment received."""
        layer = ctx.adapter.innermost_site(module_paths(node)).layer
        flops = in_t(node_flops(node, ctx), names, node)
        return OpCost(
            node.name, layer, "experts", read, nbytes(val), flops, operand=operand,
            expert_bytes=expert_bytes, assignment_flops=per_row,
        )  # fmt: skip

    pointwise = {n for n in gm.graph.nodes if n.op == "call_function" and _is_pointwise(n)}
    returned = _returned(gm)

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        layer = ctx.adapter.innermost_site(module_paths(node)).layer
        kind = collective_kind(node)
        if kind is not None:
            axis, group, sent, received = collective_bytes(node, ctx)
            wire = sympy.Max(in_t(sent, names, node), in_t(received, names, node))
            ops.append(
                OpCost(
                    node.name, layer, f"{kind}({axis})", zero, zero, zero, wire=wire, group=group
                )
            )
            continue
        if node.target in _VIEWS or node.target is operator.getitem or node.target in _FREE:
            if node.all_input_nodes:
                origin[node] = root(node.all_input_nodes[0])
            continue
        if str(node.target) == NPU_GROUPED_MATMUL:
            (val,) = val  # the grouped matmul's one output, in a list
        elif str(node.target) == NPU_SPARSE_FLASH_ATTENTION:
            val = val[0]  # the attention; its softmax statistics are not asked for (empty)
        if not isinstance(val, torch.Tensor):  # a size, a scalar read on the host
            continue
        stack = _expert_stack(node, root, weights)
        if stack:  # torch_npu's grouped matmul of a rank's stacked experts: the touched ones
            info = ep_layer_of(node, ctx)
            if info is not None:
                top_k, experts, ep = info.top_k, info.experts_per_rank * info.ep, info.ep
            (x,), (w,) = node.args[0], node.args[1]
            per_row = 2 * symbolic_size(x.meta["val"].shape[1])
            per_row *= symbolic_size(w.meta["val"].shape[2])
            expert_bytes = sum((nbytes(root(w).meta["val"]) for w in stack), zero)
            paid.update(root(w) for w in stack)
            read, _, _ = reads(node, [a for a in inputs if root(a) not in {root(w) for w in stack}])
            ops.append(experts_op(node, read, val, _operand(inputs, 1), expert_bytes, per_row))
            continue
        spec = ctx.adapter.routed_experts_op(node.target)
        if spec is not None:
            held = node.args[3].meta["val"].shape[0]
            info = ep_layer_of(node, ctx)
            # the experts a token picks: the op's routes per row without EP; with EP a row
            # may carry one assignment (`ep_rows="per_assignment"`), the layer's K is kept
            top_k = info.top_k if info is not None else int(node.args[1].meta["val"].shape[1])
            ep = info.ep if info is not None else 1
            experts = held * ep
            stacked = [node.args[i] for i in spec.weight_args()]
            expert_bytes = sum((nbytes(w.meta["val"]) for w in stacked), zero)
            for w in stacked:
                paid.add(root(w))
            read, _, _ = reads(node, [a for a in inputs if a not in stacked])
            operand = _operand(stacked, spec.inputs_per_element)
            per_row = assignment_flops(node, ctx)
            ops.append(experts_op(node, read, val, operand, expert_bytes, per_row))
            continue
        if node.target in _GATHERS:
            read, weight, cache = reads(node, inputs[1:])
            source = root(inputs[0])
            rows = nbytes(val)
            if source.op == "placeholder" and source.name in caches:
                cache += rows
            elif source.op == "placeholder" and source.name in weights:
                weight += rows
            ops.append(
                OpCost(
                    node.name,
                    layer,
                    "gather",
                    read + rows,
                    rows,
                    zero,
                    weight_bytes=weight,
                    cache_bytes=cache,
                )
            )
            continue
        read, weight, cache = reads(node, inputs)
        written = nbytes(val)
        if node in pointwise:
            kind_name = "pointwise"
            if node.users and set(node.users) <= pointwise and node not in returned:
                written = zero
        elif node.target in _MATMULS or str(node.target) in _NPU_MATMULS:
            kind_name = "matmul"
        else:
            kind_name = "other"
        flops = in_t(node_flops(node, ctx), names, node) if kind_name == "matmul" else zero
        ops.append(
            OpCost(
                node.name,
                layer,
                kind_name,
                read,
                written,
                flops,
                operand=_operand(inputs, 1) if kind_name == "matmul" else "bf16",
                weight_bytes=weight,
                cache_bytes=cache,
            )
        )

    held, per_request = _held_bytes(gm, ctx)
    global_bytes = global_experts = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node in paid:
            value = node.meta.get(GLOBAL_VAL, node.meta.get("val"))
            size = value.numel() * value.element_size()
            global_bytes += size
            if any(ctx.adapter.routed_experts_op(u.target) for u in _readers(node)):
                global_experts += size
    return StepCosts(
        tuple(ops),
        ctx.mesh.world_size,
        ctx.mesh.tp,
        experts,
        top_k,
        int(global_bytes),
        int(global_experts),
        len({op.layer for op in ops if op.layer is not None}),
        per_request,
        held,
        ep,
    )


def _held_bytes(gm: GraphModule, ctx: CompileContext) -> tuple[dict[str, int], float]:
    """(the weights this rank holds in device memory, by `StepCosts.held_weights`' keys; one
    slot of its cache tensors)."""
    held: dict[str, int] = {}
    slot = 0.0
    for held_input in rank_inputs(gm, ctx):
        shard, key = held_input.shard, held_input.param
        if key is not None:
            if shard is not None and shard.host:
                continue
            if shard is not None and shard.parts > 1:
                key += f"[{shard.dim}/{shard.parts}{shard.ranges or ''}{shard.dtype or ''}]"
            held[key] = held.get(key, 0) + int(held_input.bytes)
        elif held_input.cache:  # dim 0: the slots (the requests' and a scratch one)
            slot += held_input.bytes / held_input.value.shape[0]
    return held, slot


def step_time(costs: StepCosts, device: Device, scenario: Scenario) -> StepTime:
    """The step's predicted time on `device`, and its floors (module docstring)."""
    touched = costs.touched(scenario.world_rows)
    load = scenario.ep_load or costs.busiest(scenario.world_rows, scenario.rows)
    rate = device.hbm_bytes_per_s
    at: dict[sympy.Expr, float] = {}

    def value(expr: sympy.Expr) -> float:
        if expr not in at:
            at[expr] = float(sympy.sympify(expr).subs(T, scenario.rows))
        return at[expr]

    seconds = hbm = compute = comm = compute_floor = 0.0
    hbm_bytes = layout = cache = gathered = 0.0
    count = in_layers = 0
    timed: list[tuple[float, OpCost]] = []
    per_layer: dict[int | None, list[float]] = {}  # seconds, HBM floor bytes, compute floor
    for op in costs.ops:
        part = per_layer.setdefault(op.layer, [0.0, 0.0, 0.0])
        if op.collective:
            t = device.collective_seconds(
                value(op.wire), group=op.group, all_to_all=op.kind.startswith("all_to_all")
            )
            comm += t
            count += 1
            in_layers += op.layer is not None
        else:
            experts = value(op.expert_bytes) * load.fraction  # the busiest rank's touched
            moved = value(op.read) + value(op.written) + experts
            flops = value(op.flops)
            if op.kind == "experts" and op.assignment_flops != 0:
                flops = value(op.assignment_flops) * load.assignments  # the busiest rank's
            work = flops / device.matmul_flops(op.operand)
            t = max(moved / rate, work)
            hbm += moved / rate
            compute += work
            if op.kind in ("matmul", "experts"):
                compute_floor += work
                part[2] += work
            hbm_bytes += moved
            held = value(op.weight_bytes) + value(op.cache_bytes) + experts
            layout += held
            part[1] += held
            cache += value(op.cache_bytes)
            if op.kind == "gather":
                gathered += value(op.weight_bytes)
        seconds += t
        part[0] += t
        timed.append((t, op))
    dense = costs.global_weight_bytes - costs.global_expert_bytes
    physical = (dense + costs.global_expert_bytes * touched) / costs.world_size
    physical += cache / costs.tp + gathered
    return StepTime(
        scenario,
        device,
        seconds,
        hbm,
        compute,
        comm,
        count,
        in_layers,
        hbm_bytes,
        layout / rate,
        physical / rate,
        compute_floor,
        timed,
        {layer: LayerTime(t, held / rate, work) for layer, (t, held, work) in per_layer.items()},
    )


def _expert_stack(node: Node, root: Any, weights: set[str]) -> list[Node]:
    """The stacked expert weights (and their scales) a grouped matmul of torch_npu reads: its
    3-D `weight` and `antiquant_scale` made of the rank's experts (a placeholder of the model's
    weights, through views), or none for another grouped matmul."""
    if str(node.target) != NPU_GROUPED_MATMUL:
        return []
    stack = []
    for key in ("weight", "antiquant_scale"):
        given = node.kwargs.get(key) if key != "weight" else node.args[1]
        for w in cast(list, given or []):
            source = root(w)
            if source.op == "placeholder" and source.name in weights and w.meta["val"].dim() >= 3:
                stack.append(w)
    return stack


def _is_pointwise(node: Node) -> bool:
    return torch.Tag.pointwise in getattr(node.target, "tags", ())


def _returned(gm: GraphModule) -> set[Node]:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return set(output.all_input_nodes)


def _readers(node: Node) -> list[Node]:
    """The nodes that read `node`, through views."""
    found, todo = [], list(node.users)
    while todo:
        user = todo.pop()
        if user.target in _VIEWS or user.target is operator.getitem:
            todo.extend(user.users)
        else:
            found.append(user)
    return found


def _operand(inputs: list[Node], per_element: int) -> str:
    """The narrowest operand of a matmul: "fp4" for packed FP4 (two values per byte), "fp8"
    for a float8 dtype, else "bf16"."""
    dtypes = {a.meta["val"].dtype for a in inputs}
    if per_element == 2:
        return "fp4"
    if any(d.is_floating_point and d.itemsize == 1 for d in dtypes):
        return "fp8"
    return "bf16"
