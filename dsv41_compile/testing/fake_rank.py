"""One rank of a fake world: the rewritten graph a rank compiles, without other processes.

`compile_on_fake_rank(rank, options)` compiles a model (tiny-swa with 3 Sinkhorn iterations
by default: `testing.presets.compile_config`) with `dsv41_sp` as rank `rank` of a `fake`
process group of 8 ranks (collectives move no data) and runs it once: it returns that rank's
rewritten graph, its compile context and the logits (which mean nothing: no data moved).
Results are kept for the process, keyed by the arguments: a test session compiles each
configuration once. `run_on_fake_rank` only calls the model: nothing watches the pipeline, so
the host's compile cache (`runtime.host_cache`) serves every rank of a graph compiled before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import GraphModule

import dsv41_compile
from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.meta import OUT, REGION
from dsv41_compile.core.placements import format_placement
from dsv41_compile.model import DeepseekV41, ModelConfig
from dsv41_compile.report.dump import graph_labels
from dsv41_compile.report.graph_printer import format_graph
from dsv41_compile.testing.batches import Request, pack
from dsv41_compile.testing.capture import capture_programs
from dsv41_compile.testing.presets import compile_config
from dsv41_compile.testing.torch_shims import fake_process_group

__all__ = [
    "REQUESTS",
    "compile_model_on_fake_rank",
    "compile_on_fake_rank",
    "collective_windows",
    "layer_text",
    "placement_counts",
    "run_on_fake_rank",
]

REQUESTS = (Request(0, (1, 2, 3), 0), Request(1, (4, 5), 0), Request(2, (6, 7, 8), 0))
"""The requirement's example batch of one DP group: requests of 3, 2 and 3 tokens."""

_COMPILED: dict[tuple, tuple[GraphModule, CompileContext, torch.Tensor]] = {}


def compile_on_fake_rank(
    rank: int,
    options: dict[str, Any],
    cfg: ModelConfig | None = None,
    requests: Sequence[Request] = REQUESTS,
    *,
    mark: bool = True,
    world_size: int = 8,
) -> tuple[GraphModule, CompileContext, torch.Tensor]:
    """Rank `rank`'s rewritten graph of `cfg` (`compile_config()`) under `options` (eager
    lowering unless given), its context and its logits on `requests`; `mark`: the token count
    is marked (`mark_token_dim`), else Dynamo traces it as it does a first call."""
    cfg = cfg or compile_config()
    requests = tuple(Request(r.slot, tuple(r.ids), r.start) for r in requests)
    key = (rank, tuple(sorted(options.items())), cfg, requests, mark, world_size)
    if key not in _COMPILED:
        model, args, marked = _model_and_inputs(cfg, requests, mark)
        _COMPILED[key] = compile_model_on_fake_rank(
            model, args, options, rank=rank, world_size=world_size, token_inputs=marked
        )
    return _COMPILED[key]


def run_on_fake_rank(
    rank: int,
    options: dict[str, Any],
    cfg: ModelConfig | None = None,
    requests: Sequence[Request] = REQUESTS,
) -> torch.Tensor:
    """The logits of `cfg` (`compile_config()`) compiled with `dsv41_sp` under `options` as rank
    `rank` of a fake world of 8 and called on `requests`, the token count marked. Not kept, and
    not watched: a graph the host compiled before is loaded from its compile cache."""
    model, args, marked = _model_and_inputs(cfg or compile_config(), requests, True)
    return _compiled_call(model, args, options, rank, 8, marked)


def _model_and_inputs(
    cfg: ModelConfig, requests: Sequence[Request], mark: bool
) -> tuple[DeepseekV41, tuple[Any, ...], tuple[torch.Tensor, ...]]:
    """The model (seed 0), its arguments for `requests` and the token inputs to mark."""
    torch.manual_seed(0)
    model = DeepseekV41(cfg)
    ids, positions, slots = pack(list(requests))
    marked = (ids, positions, slots) if mark else ()
    return model, (ids, positions, slots, model.new_cache(4, 32)), marked


def compile_model_on_fake_rank(
    model: torch.nn.Module,
    args: Sequence[Any],
    options: dict[str, Any],
    *,
    rank: int = 1,
    world_size: int = 8,
    token_inputs: Sequence[torch.Tensor] = (),
) -> tuple[GraphModule, CompileContext, Any]:
    """Any model of a known family (`models`) compiled with `dsv41_sp` as rank `rank` of a fake
    world and called once on `args`: its rewritten graph, its context and its output (which
    means nothing: no data moved). `token_inputs` are marked with `mark_token_dim`."""
    with capture_programs() as programs:
        out = _compiled_call(model, args, options, rank, world_size, token_inputs)
    (gm, ctx), *_ = programs
    return gm, ctx, out


def _compiled_call(
    model: torch.nn.Module,
    args: Sequence[Any],
    options: dict[str, Any],
    rank: int,
    world_size: int,
    token_inputs: Sequence[torch.Tensor],
) -> Any:
    """`compile_model_on_fake_rank`'s compile and call, nothing watching the pipeline (eager
    lowering unless `options` say otherwise): the output."""
    torch.compiler.reset()
    with fake_process_group(world_size=world_size, rank=rank):
        if token_inputs:
            dsv41_compile.mark_token_dim(*token_inputs)
        compiled = torch.compile(
            model, backend="dsv41_sp", options={"lowering": "eager", **options}, fullgraph=True
        )
        return compiled(*args)


def layer_text(gm: GraphModule, ctx: CompileContext, region: str) -> str:
    """One region of the graph (e.g. "layers.1.attn") as snapshot text: stable names."""
    labels, groups = graph_labels(ctx)
    return format_graph(gm, labels=labels, groups=groups, region=region, stable_names=True)


def collective_windows(text: str, context: int = 2) -> str:
    """The lines of a region's snapshot text (`layer_text`) around each collective: `context`
    lines either side, windows that overlap merged, `...` between them. What a snapshot pins
    of a block: where it talks, and what it hands over; `placement_counts` pins the rest."""
    lines = text.splitlines()
    keep: set[int] = set()
    for i, line in enumerate(lines):
        if "_c10d_functional." in line.split("#")[0] and "wait_tensor" not in line.split("#")[0]:
            keep.update(range(max(0, i - context), min(len(lines), i + context + 2)))
    out: list[str] = []
    for i in sorted(keep):
        if out and i - 1 not in keep:
            out.append("...")
        out.append(lines[i])
    return "\n".join(out)


def placement_counts(gm: GraphModule, region: str) -> dict[str, int]:
    """How many ops of `region` (and its submodules, as `layer_text` selects them) have each
    output placement, e.g. `{"R": 20, "S(0)": 31, "-": 12}` ("-": no tensor placement, as on
    the nodes a rewrite inserted after localize)."""
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        node_region = node.meta.get(REGION, "")
        if node.op != "call_function" or not (
            node_region == region or node_region.startswith(region + ".")
        ):
            continue
        out = node.meta.get(OUT)
        if isinstance(out, tuple):
            key = "(" + ", ".join(format_placement(p) for p in out) + ")"
        else:
            key = format_placement(out)
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))
