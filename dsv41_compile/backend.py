"""The `dsv41_sp` torch.compile backend and its options.

    compiled = torch.compile(model, backend="dsv41_sp", options={"tp": 4})

Dynamo captures the model; AOTAutograd gives the functional ATen inference graph; the pipeline
(`passes.py`) places, communicates, localizes and validates it; the lowering compiles the
per-rank graph. Every rank compiles the same graph; only the `tp_rank` input differs.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo.backends.registry import register_backend
from torch._functorch.aot_autograd import aot_module_simplified
from torch._guards import detect_fake_mode
from torch.fx import GraphModule
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dsv41_compile.context import CompileContext
from dsv41_compile.fx_utils import module_paths
from dsv41_compile.lowering import lower
from dsv41_compile.mesh import build_mesh
from dsv41_compile.passes import run_pipeline
from dsv41_compile.propagation.plan import deepseek_v41_plan

__all__ = ["BackendOptions", "dsv41_sp", "mark_token_dim"]

_LAYOUTS = ("sp", "replicated")
_LOWERINGS = ("auto", "eager", "inductor", "torchair")
_EMBEDDINGS = ("replicated", "vocab_sharded")
_EP_DISPATCH = ("exact", "padded")


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
    layout: str = "sp"
    """"sp": token-sharded residuals, AllGather in / ReduceScatter out of attention (DESIGN §2).
    "replicated": the baseline sp replaces (DESIGN §6): residuals replicated over the TP group,
    attention output all-reduced, with ep > 1 each token dispatched by one TP rank and the MoE
    output all-gathered back."""
    lowering: str = "auto"
    """"eager", "inductor", "torchair" (Ascend NPU graph mode; needs torch_npu and
    ep_dispatch="padded"), or "auto" (inductor on CPU / GPU, torchair on NPU)."""
    dump_dir: str | None = None
    """Where to write `rank{r}/graph.py` and `rank{r}/comm.json` at compile time."""
    embedding: str = "replicated"
    """"replicated" (local lookup of the token shard) or "vocab_sharded" (rows sharded over
    tp; the partial lookups are reduce-scattered to the token shards)."""

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be a positive int, got {self.tp!r}")
        if not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"ep must be a positive int, got {self.ep!r}")
        for name, allowed in (
            ("layout", _LAYOUTS),
            ("lowering", _LOWERINGS),
            ("embedding", _EMBEDDINGS),
            ("ep_dispatch", _EP_DISPATCH),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not supported; choose one of {allowed}"
                )
        if self.lowering == "torchair" and self.ep > 1 and self.ep_dispatch == "exact":
            raise ValueError(
                "lowering='torchair' needs ep_dispatch='padded' with ep > 1: the exact EP "
                "lowering reads the assignment counts on the host (data-dependent sizes), which "
                "torchair's GE graphs cannot run"
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
        return BackendOptions(**options)

    def resolved_lowering(self, device_type: str) -> str:
        if self.lowering != "auto":
            return self.lowering
        if device_type in ("cpu", "cuda"):
            return "inductor"
        if device_type == "npu":
            return "torchair"
        raise ValueError(
            f"lowering='auto' has no compiler for device {device_type!r}; pass lowering='eager'"
        )


def mark_token_dim(*tensors: torch.Tensor) -> None:
    """Make the token dim (dim 0) of the model inputs a size-oblivious symbol, so one compiled
    graph serves every token count, T = 1 included. Call it on `input_ids`, `positions` and
    `slots` before each call of the compiled model.

    A *backed* dynamic size is specialised at 0 and 1 by Dynamo: a decode step with T = 1 would
    get its own static graph, in which size-1 token dims look like broadcast dims to the
    decompositions and the sharding rules."""
    from torch._dynamo.decorators import mark_unbacked

    for t in tensors:
        mark_unbacked(t, 0)


_SOURCE_KEYS = re.compile(r"\['([^']+)'\]")
_REQUIRED_MODULES = ("embed", "head")


def _fqn(source: str) -> str | None:
    """`L['self']._modules['layers']._modules['0']._parameters['w']` -> `layers.0.w`."""
    if not source.startswith("L['self']") or not re.search(r"_(parameters|buffers)\[", source):
        return None
    return ".".join(_SOURCE_KEYS.findall(source.removeprefix("L['self']")))


def _input_name(source: str) -> str:
    """`L['cache'].window_kv[0]` -> `cache.window_kv[0]`."""
    return re.sub(r"^L\['([^']+)'\]", r"\1", source)


def _check_whole_model(gm: GraphModule) -> None:
    seen = {p.split(".")[0] for n in gm.graph.nodes for p in module_paths(n)}
    missing = [m for m in _REQUIRED_MODULES if m not in seen]
    if missing:
        raise ValueError(
            "dsv41_sp compiles the whole model as one graph, but this graph has no "
            f"{' / '.join(missing)} module: Dynamo split the model at a graph break. Compile "
            "with torch.compile(..., fullgraph=True) to see where, and remove the break."
        )


def _check_token_count(gm: GraphModule, ctx: CompileContext) -> None:
    node = next(n for n in gm.graph.nodes if n.name == ctx.token_input)
    if statically_known_true(node.meta["val"].shape[0] == 1):
        raise ValueError(
            "dsv41_sp got a graph specialised to one token (T = 1): token dims of size 1 are "
            "indistinguishable from broadcast dims, so the sharding cannot be derived. Call "
            "dsv41_compile.mark_token_dim(input_ids, positions, slots) before each call (one "
            "graph then serves every T)"
        )


@register_backend(name="dsv41_sp")
def dsv41_sp(
    gm: GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None
) -> Any:
    """The `dsv41_sp` backend. See `BackendOptions` for `options`."""
    opts = BackendOptions.from_dict(options)
    _check_whole_model(gm)
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    device_type = tensors[0].device.type if tensors else "cpu"
    if opts.lowering == "torchair" and device_type != "meta":
        from dsv41_compile.lowering.torchair import import_torchair

        import_torchair()  # fail before compiling when torch_npu is missing
    # Meta tensors: planning only (`planning.plan_rank`), nothing runs; the mesh lives on CPU.
    mesh = build_mesh(
        tp=opts.tp, ep=opts.ep, device_type="cpu" if device_type == "meta" else device_type
    )
    sources = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            grapharg = node.meta.get("grapharg")
            sources.append(grapharg.source.name if grapharg is not None else node.name)

    def compile_rank(aten_gm: GraphModule, aten_inputs: list[Any]) -> Any:
        placeholders = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(sources):
            raise AssertionError(
                f"AOT graph has {len(placeholders)} inputs, Dynamo graph {len(sources)}"
            )
        param_fqns, input_sources = {}, {}
        for node, source in zip(placeholders, sources):
            fqn = _fqn(source)
            if fqn is not None:
                param_fqns[node.name] = fqn
            else:
                input_sources[node.name] = _input_name(source)
        token = [n for n, s in input_sources.items() if s == "input_ids"]
        if not token:
            raise ValueError(
                "dsv41_sp expects the model ABI `model(input_ids, positions, slots, cache)`: no "
                f"input named input_ids among {sorted(set(input_sources.values()))}"
            )
        ctx = CompileContext(
            mesh=mesh,
            options=opts,
            plan=deepseek_v41_plan(embedding=opts.embedding, ep=opts.ep, layout=opts.layout),
            param_fqns=param_fqns,
            input_sources=input_sources,
            token_input=token[0],
            fake_mode=detect_fake_mode(aten_inputs),
        )
        _check_token_count(aten_gm, ctx)
        run_pipeline(aten_gm, ctx)
        on_ep_stats = None
        if opts.dump_dir is not None:
            from dsv41_compile.dump import EpStepLog, dump

            out = dump(aten_gm, ctx, opts.dump_dir)
            if ctx.ep_layers:
                on_ep_stats = EpStepLog(out / "comm.json", ctx)
        return lower(aten_gm, ctx, on_ep_stats)

    return aot_module_simplified(
        gm, example_inputs, fw_compiler=compile_rank, inference_compiler=compile_rank
    )
