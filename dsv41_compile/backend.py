"""The `dsv41_sp` torch.compile backend.

    compiled = torch.compile(model, backend="dsv41_sp", options={"tp": 4, "ep": 8})

Dynamo captures the model; `frontend` reads what each input is, picks the model family's
adapter and makes the token count symbolic; AOTAutograd gives the functional ATen inference
graph; the pipeline (`pipeline.py`) places, communicates, localizes and verifies it; a target
compiles the per-rank graph (`targets`), and `runtime.program.ShardedProgram` runs it per call.
Every rank compiles the same graph -- the rank enters as the `tp_rank` input -- so one rank per
host compiles it and the others load it (`runtime.host_cache`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.backends.registry import register_backend
from torch._dynamo.exc import TensorifyScalarRestartAnalysis
from torch._functorch.aot_autograd import aot_module_simplified
from torch._guards import TracingContext, detect_fake_mode
from torch._subclasses.fake_tensor import is_fake
from torch.fx import GraphModule, Node

from dsv41_compile.core.adapter import ModelAdapter
from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.hooks import active
from dsv41_compile.core.mesh import Mesh, build_mesh
from dsv41_compile.core.meta import GLOBAL_VAL
from dsv41_compile.core.passes import PassManager
from dsv41_compile.core.regions import (
    renamed_symbols,
    trace_kinds_once,
    trace_regions_with_meta,
)
from dsv41_compile.frontend import (
    GraphInputs,
    check_recompiles,
    check_whole_model,
    generalize_token_count,
    read_inputs,
    symbolic_token_inputs,
)
from dsv41_compile.models import adapter_for
from dsv41_compile.moe.stats import EP_TOKENS
from dsv41_compile.options import BackendOptions
from dsv41_compile.pipeline import PIPELINE
from dsv41_compile.report.comm import comm_records
from dsv41_compile.report.dump import EpStepLog, graph_text, write_dump, write_graph
from dsv41_compile.runtime.host_cache import (
    STATS,
    Artifact,
    add_guards,
    canonical_symbols,
    load_graph,
    program_key,
    restart_like,
    restart_requested,
    save_graph,
    saved_guards,
    shared,
)
from dsv41_compile.runtime.program import ProgramReport, ProgramSpec, ShardedProgram
from dsv41_compile.runtime.weights import rank_weights, weight_inputs
from dsv41_compile.storage import has_no_weights
from dsv41_compile.targets import Handoff, compile_graph

__all__ = ["BackendOptions", "dsv41_sp", "mark_token_dim"]

PASSES = PassManager(PIPELINE, write_graph=write_graph)


def mark_token_dim(*tensors: torch.Tensor) -> None:
    """Make the token dim (dim 0) of the model inputs an unbacked symbol, so that one compiled
    graph serves every token count, 0 and 1 included. Call it on `input_ids`, `positions` and
    `slots` before each call of the compiled model.

    Without it the model still compiles and runs at every T, but Dynamo decides when to trace
    again: a static graph for the first T, a dynamic one from the second T on, and a static
    graph of its own for T = 0 and for T = 1 (docs/backend.md, "Token counts")."""
    from torch._dynamo.decorators import mark_unbacked

    for t in tensors:
        mark_unbacked(t, 0)


@register_backend(name="dsv41_sp")
def dsv41_sp(
    gm: GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None
) -> Any:
    """The `dsv41_sp` backend. See `BackendOptions` for `options`."""
    opts = BackendOptions.from_dict(options)
    inputs = read_inputs(gm)
    adapter = adapter_for(inputs.param_fqns.values(), inputs.input_names.values(), opts.layout)
    check_recompiles(adapter)
    check_whole_model(gm, adapter)
    _token_index(inputs, adapter)  # before AOTAutograd: a misnamed input fails at once
    _check_inference(example_inputs, inputs)
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    device_type = tensors[0].device.type if tensors else "cpu"
    # Meta tensors: planning only (`planning.plan_rank`), nothing runs; the mesh lives on CPU.
    planning = device_type == "meta"
    if not planning:
        _check_weights(example_inputs, inputs, opts)
    target = opts.target("cpu" if planning else device_type)
    if target == "torchair" and not planning:
        from dsv41_compile.targets.torchair import import_torchair

        import_torchair()  # fail before compiling when torch_npu is missing
    mesh = build_mesh(tp=opts.tp, ep=opts.ep, device_type="cpu" if planning else device_type)
    adapter.check(opts, {fqn: example_inputs[i].shape for i, fqn in inputs.param_fqns.items()})
    # The key is Dynamo's graph as traced: a rank that loads skips the generalization too.
    fakes = _fakes(example_inputs)
    names = canonical_symbols(fakes)
    key = None if planning else _shared_key(gm, fakes, opts, mesh, adapter.name, target)
    if key is None or names is None:
        return _compile(gm, example_inputs, inputs, opts, mesh, adapter, target)
    shape_env = TracingContext.get().fake_mode.shape_env
    with shared(key) as slot:
        if slot.artifact is None:
            STATS["compiled"] += 1
            since = len(shape_env.guards)
            saved: list[Artifact] = []
            try:
                compiled = _compile(
                    gm, example_inputs, inputs, opts, mesh, adapter, target, saved.append
                )
            except TensorifyScalarRestartAnalysis:
                slot.store(Artifact(b"", None, None, restart=restart_requested()))
                raise
            guards = saved_guards(shape_env, since, names)
            if guards is not None:  # else every rank compiles for itself
                slot.store(dataclasses.replace(saved[0], guards=guards))
            return compiled
        artifact = slot.artifact
    STATS["loaded"] += 1
    # The lock is released: the host's other ranks load the artifact at the same time.
    if artifact.restart is not None:
        restart_like(artifact.restart)
    add_guards(shape_env, artifact.guards, names)
    local = symbolic_token_inputs(gm, fakes, inputs, adapter)
    program = _load(artifact, local, opts, mesh, target, adapter)
    return lambda *args: program(list(args))


def _compile(
    gm: GraphModule,
    example_inputs: list[Any],
    inputs: GraphInputs,
    opts: BackendOptions,
    mesh: Mesh,
    adapter: ModelAdapter,
    target: str,
    save: Callable[[Artifact], None] | None = None,
) -> Any:
    """The token count made symbolic, AOTAutograd, the pipeline and the target, on this rank;
    `save` receives the result for the host's other ranks."""
    start = time.perf_counter()
    traced_inputs = example_inputs
    gm, example_inputs = generalize_token_count(gm, example_inputs, inputs, adapter)
    trace_regions_with_meta(gm)  # each layer kind's ATen nodes with their module paths
    generalized = time.perf_counter()
    # each layer kind's ATen traced once, its calls operators
    kinds = trace_kinds_once(gm, renamed_symbols(traced_inputs, example_inputs))
    traced = time.perf_counter()

    def compile_rank(aten_gm: GraphModule, aten_inputs: list[Any]) -> Any:
        kinds.attach(aten_gm)
        ctx = _context(aten_gm, aten_inputs, inputs, opts, mesh, adapter, target)
        ctx.stage_seconds = {
            "generalize": generalized - start,
            "kinds": traced - generalized,
            "aot": time.perf_counter() - traced,
        }
        ctx.kinds_traced = len(kinds.bodies)
        PASSES.run(aten_gm, ctx)
        for hooks in active():
            if hooks.on_pipeline is not None:
                hooks.on_pipeline(aten_gm, ctx)
        spec, report = _program(aten_gm, ctx)
        if save is not None:
            save(Artifact(save_graph(aten_gm), spec, report))
        compiled = compile_graph(aten_gm, Handoff.of(aten_gm, ctx))
        return _bind(compiled, spec, report, opts, mesh, adapter)

    try:
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=compile_rank,
            inference_compiler=compile_rank,
            keep_inference_input_mutations=True,  # the cache writes stay in the graph
        )
    finally:
        kinds.close()


def _token_index(inputs: GraphInputs, adapter: ModelAdapter) -> int:
    """The index among the graph's inputs of the model's token input (`input_ids`)."""
    token = inputs.index_of(adapter.token_inputs[0])
    if token is None:
        names = sorted({n for n in inputs.input_names.values() if ".size()" not in n})
        raise ValueError(
            f"dsv41_sp expects the {adapter.name} model's inputs "
            f"{', '.join(adapter.token_inputs)}: no input named {adapter.token_inputs[0]} among "
            f"{names}"
        )
    return token


def _check_weights(example_inputs: list[Any], inputs: GraphInputs, opts: BackendOptions) -> None:
    """Without the `checkpoint` option the program runs on the model's parameters: each must
    have its values."""
    if opts.checkpoint is not None:
        return
    empty = [
        fqn
        for i, fqn in inputs.param_fqns.items()
        if i not in inputs.buffers and has_no_weights(example_inputs[i])
    ]
    if empty:
        raise ValueError(
            f"{len(empty)} parameters of this model have no weights ({empty[0]}, ...): pass "
            "options checkpoint=DIR (each rank reads only its own shards), or load the weights "
            "into the model first"
        )


def _check_inference(example_inputs: list[Any], inputs: GraphInputs) -> None:
    """AOTAutograd traces a training graph when a parameter requires grad in grad mode."""
    if not torch.is_grad_enabled():
        return
    trained = [fqn for i, fqn in inputs.param_fqns.items() if example_inputs[i].requires_grad]
    if trained:
        raise ValueError(
            f"dsv41_sp compiles inference graphs, but {len(trained)} parameters of this model "
            f"require grad ({trained[0]}, ...) and grad mode is on; call the compiled model "
            "under torch.no_grad() or torch.inference_mode(), or call "
            "model.requires_grad_(False) first"
        )


def _shared_key(
    gm: GraphModule,
    fakes: list[Any],
    opts: BackendOptions,
    mesh: Mesh,
    adapter: str,
    target: str,
) -> str | None:
    """The host cache key of this compile, or None when it is not shared
    (`runtime.host_cache`)."""
    hooks = active()
    tags = tuple(p.cache_tag for h in hooks for p in h.extra_passes)
    watched = any(h.stop_after or h.after_pass or h.on_pipeline for h in hooks)
    if not opts.share_compile or opts.dump_after or None in tags or watched:
        return None  # the pipeline must run here
    parts = (opts.cache_key(), mesh.world_size, mesh.tp, mesh.ep, mesh.device_type, target)
    dumps = opts.dump_dir is not None  # an artifact holds its graph's text only then
    return program_key(gm, fakes, (*parts, adapter, tags, dumps))


def _fakes(example_inputs: list[Any]) -> list[Any]:
    """Dynamo's fake values of the inputs (the real ones it was given map to them)."""
    fake_mode = TracingContext.get().fake_mode
    return [
        fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not is_fake(x) else x
        for x in example_inputs
    ]


def _load(
    artifact: Artifact,
    fakes: list[Any],
    opts: BackendOptions,
    mesh: Mesh,
    target: str,
    adapter: ModelAdapter,
) -> ShardedProgram:
    """The program another rank of the host compiled, bound to this rank: no AOTAutograd, no
    pipeline; inductor finds its kernels in its caches. The graph keeps the model's cache
    writes (AOTAutograd's `keep_inference_input_mutations`) and aliases no input, so the
    program is called with Dynamo's inputs as they are."""
    gm = load_graph(artifact.graph)
    local = _local_fakes(artifact.spec, fakes, opts.checkpoint is not None)
    handoff = Handoff(
        target, local, artifact.spec.param_indices, TracingContext.get().fake_mode, opts, mesh.rank
    )
    return _bind(compile_graph(gm, handoff), artifact.spec, artifact.report, opts, mesh, adapter)


def _local_fakes(spec: ProgramSpec, fakes: list[Any], checkpoint: bool) -> list[Any]:
    """Fake values of the per-rank graph's inputs: the model's (`fakes`), with parameter shards
    at their local shape (every parameter contiguous when `checkpoint`: the rank's own
    tensors), then `tp_rank` (and `ep_tokens`)."""
    fake_mode = TracingContext.get().fake_mode
    fakes = list(fakes)
    loaded = [i for i, *_ in spec.params] if checkpoint else []
    for index in {*spec.param_shards, *loaded}:  # contiguous, as the program passes them
        full, shard = fakes[index], spec.param_shards.get(index)
        shape = list(full.shape) if shard is None else shard.local_shape(list(full.shape))
        with fake_mode:
            fakes[index] = torch.empty(shape, dtype=full.dtype)
    with fake_mode:
        fakes.append(torch.zeros((), dtype=torch.int64))
    if spec.ep_tokens_input:
        shape_env = fake_mode.shape_env
        with shape_env.ignore_fresh_unbacked_symbols():
            fakes.append(shape_env.create_unbacked_symint())
    return fakes


def _context(
    aten_gm: GraphModule,
    aten_inputs: list[Any],
    inputs: GraphInputs,
    opts: BackendOptions,
    mesh: Mesh,
    adapter: ModelAdapter,
    target: str,
) -> CompileContext:
    placeholders = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    expected = len(inputs.param_fqns) + len(inputs.input_names)
    if len(placeholders) != expected:
        raise InternalError(f"the AOT graph has {len(placeholders)} inputs, Dynamo's {expected}")
    param_fqns = {placeholders[i].name: fqn for i, fqn in inputs.param_fqns.items()}
    input_sources = {placeholders[i].name: name for i, name in inputs.input_names.items()}
    # "auto" cuts decided for this model's sizes: the passes see the options they chose.
    params = {fqn: placeholders[i].meta["val"] for i, fqn in inputs.param_fqns.items()}
    opts, choices = adapter.resolve(opts, params)
    return CompileContext(
        mesh=mesh,
        options=opts,
        adapter=adapter,
        plan=adapter.plan(opts),
        choices=choices,
        target=target,
        param_fqns=param_fqns,
        buffers=frozenset(placeholders[i].name for i in inputs.buffers),
        input_sources=input_sources,
        token_input=placeholders[_token_index(inputs, adapter)].name,
        fake_mode=detect_fake_mode(aten_inputs),
    )


def _param_input(
    index: int, node: Node, ctx: CompileContext
) -> tuple[int, str, tuple[int, ...], torch.dtype]:
    val = node.meta.get(GLOBAL_VAL, node.meta["val"])
    return index, ctx.param_fqns[node.name], tuple(int(s) for s in val.shape), val.dtype


def _program(gm: GraphModule, ctx: CompileContext) -> tuple[ProgramSpec, ProgramReport]:
    placeholder_nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    placeholders = [n.name for n in placeholder_nodes]
    names = {name: placeholder for placeholder, name in ctx.input_sources.items()}
    spec = ProgramSpec(
        param_shards=dict(ctx.param_shards),
        token_index=placeholders.index(ctx.token_input),
        token_inputs=tuple(
            (placeholders.index(names[name]), name) for name in ctx.adapter.token_inputs
        ),
        param_indices=frozenset(i for i, n in enumerate(placeholders) if n in ctx.param_fqns),
        ep_layers=tuple(ctx.ep_layers),
        ep_tokens_input=EP_TOKENS in placeholders,
        params=tuple(_param_input(i, node, ctx) for i, node in enumerate(placeholder_nodes)
                     if node.name in ctx.param_fqns and node.name not in ctx.buffers),
    )  # fmt: skip
    text = graph_text(gm, ctx) if ctx.options.dump_dir is not None else None  # seconds at flash
    report = ProgramReport(text, ctx.comm or comm_records(gm, ctx))
    return spec, report


def _bind(
    compiled: Callable[..., Any],
    spec: ProgramSpec,
    report: ProgramReport,
    opts: BackendOptions,
    mesh: Mesh,
    adapter: ModelAdapter,
) -> ShardedProgram:
    """The program of this rank: its weights read (the `checkpoint` option), its dumps
    written, its hooks called."""
    weights = None
    if opts.checkpoint is not None:
        weights = rank_weights(
            adapter, opts.checkpoint, weight_inputs(spec.params, spec.param_shards, mesh),
            device_type=mesh.device_type, skip_unimplemented_parts=opts.skip_unimplemented_parts,
        )  # fmt: skip
    on_ep_stats = None
    if opts.dump_dir is not None:
        if report.text is None:
            raise InternalError("a program compiled without its graph text is asked to dump it")
        out = write_dump(opts.dump_dir, mesh, opts, report.text, report.comm, list(spec.ep_layers))
        if spec.ep_layers:
            on_ep_stats = EpStepLog(out / "comm.json", list(spec.ep_layers), mesh.rank)
    program = ShardedProgram.for_mesh(
        compiled, spec, mesh, report=report, on_ep_stats=on_ep_stats,
        check_inputs=opts.check_inputs, weights=weights,
    )  # fmt: skip
    for hooks in active():
        if hooks.on_program is not None:
            hooks.on_program(program)
    return program
