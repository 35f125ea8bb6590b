"""The `dsv41_sp` torch.compile backend.

    compiled = torch.compile(model, backend="dsv41_sp", options={"tp": 4, "ep": 8})

One route through a compile: `frontend.capture` reads Dynamo's graph (its inputs, the model
family, the token count) and checks it; the graph's token count is made symbolic; AOTAutograd
gives the functional ATen inference graph; the pipeline (`pipeline.py`) places, communicates,
localizes and verifies it and the target compiles it (`targets`); `runtime.program.
ShardedProgram` runs it per call. Every rank compiles the same graph -- the rank enters as the
`tp_rank` input -- so one rank per host compiles it and the others load it
(`runtime.host_cache`), skipping everything after `capture`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.hooks import active, pass_manager
from dsv41_compile.core.mesh import Mesh, build_mesh
from dsv41_compile.core.torch_private import (
    TensorifyScalarRestartAnalysis,
    TracingContext,
    aot_module_simplified,
    detect_fake_mode,
    mark_unbacked,
    register_backend,
)
from dsv41_compile.frontend import (
    Captured,
    branches_on_tokens,
    capture,
    mark_call,
    specializes_tokens,
)
from dsv41_compile.moe.stats import ep_layers
from dsv41_compile.options import BackendOptions
from dsv41_compile.pipeline import check_dump_after, passes
from dsv41_compile.regions import renamed_symbols, trace_kinds_once, trace_regions_with_meta
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
from dsv41_compile.runtime.program import ProgramSpec, ShardedProgram
from dsv41_compile.runtime.weights import rank_weights
from dsv41_compile.targets import TARGETS, Handoff, Target
from dsv41_compile.targets.torchair import import_torchair

__all__ = ["BackendOptions", "dsv41_sp", "mark_token_dim"]


def mark_token_dim(*tensors: torch.Tensor) -> None:
    """Make the token dim (dim 0) of the model inputs an unbacked symbol, so that one compiled
    graph serves every token count, 0 and 1 included. Call it on `input_ids`, `positions` and
    `slots` before each call of the compiled model.

    Without it the model still compiles and runs at every T, but Dynamo decides when to trace
    again: a static graph for the first T, a dynamic one from the second T on, and a static
    graph of its own for T = 0 and for T = 1 (docs/backend.md, "Token counts")."""
    for t in tensors:
        mark_unbacked(t, 0)


@dataclass(frozen=True)
class _Build:
    """How this rank builds the program: the options, its mesh, the target."""

    options: BackendOptions
    mesh: Mesh
    target: Target


@register_backend(name="dsv41_sp")
def dsv41_sp(
    gm: GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None
) -> Any:
    """The `dsv41_sp` backend. See `BackendOptions` for `options`."""
    opts = BackendOptions.from_dict(options)
    check_dump_after(opts)
    captured = capture(gm, example_inputs, opts)
    # Meta tensors: planning only (`planning.plan_rank`), nothing runs; the mesh lives on CPU.
    device_type = "cpu" if captured.planning else captured.device_type
    target = TARGETS[opts.target(device_type)]
    if target.name == "torchair" and not captured.planning:
        import_torchair()  # fail before compiling when torch_npu is missing
    mesh = build_mesh(tp=opts.tp, ep=opts.ep, device_type=device_type)
    captured.adapter.check(opts, captured.param_shapes())
    build = _Build(opts, mesh, target)
    # The key is Dynamo's graph as traced: a rank that loads skips the generalization too.
    names = canonical_symbols(captured.fakes)
    key = None if captured.planning else _shared_key(captured, build)
    if key is None or names is None:
        return _compile(captured, build)
    shape_env = TracingContext.get().fake_mode.shape_env
    with shared(key) as slot:
        if slot.artifact is None:
            STATS["compiled"] += 1
            since = len(shape_env.guards)
            saved: list[Artifact] = []
            try:
                compiled = _compile(captured, build, saved.append)
            except TensorifyScalarRestartAnalysis:
                slot.store(Artifact(b"", None, restart=restart_requested()))
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
    program = _load(artifact, captured, build)
    return lambda *args: program(list(args))


def _compile(
    captured: Captured, build: _Build, save: Callable[[Artifact], None] | None = None
) -> Any:
    """The token count made symbolic, AOTAutograd, the pipeline and the target, on this rank;
    `save` receives the result for the host's other ranks."""
    start = time.perf_counter()
    gm, example_inputs = captured.generalized()
    trace_regions_with_meta(gm)  # each layer kind's ATen nodes with their module paths
    generalized = time.perf_counter()
    # each layer kind's ATen traced once, its calls operators
    kinds = trace_kinds_once(gm, renamed_symbols(captured.example_inputs, example_inputs))
    traced = time.perf_counter()

    def compile_rank(aten_gm: GraphModule, aten_inputs: list[Any]) -> Any:
        kinds.attach(aten_gm)
        ctx = _context(aten_gm, aten_inputs, captured, build)
        count = aten_inputs[captured.token_index].shape[0]
        if not isinstance(count, torch.SymInt) or count.node.expr.is_number:
            # the token count became a number in AOTAutograd's trace: name the op
            inputs = captured.symbolic_inputs(captured.fakes)
            mark = mark_call(captured.adapter)
            specialized = specializes_tokens(gm, inputs, captured.token_index, mark)
            if specialized is not None:
                raise specialized
        ctx.stage_seconds = {
            "generalize": generalized - start,
            "kinds": traced - generalized,
            "aot": time.perf_counter() - traced,
        }
        ctx.kinds_traced = len(kinds.bodies)
        pass_manager(passes(build.target), write_graph=write_graph).run(aten_gm, ctx)
        for hooks in active():
            if hooks.on_pipeline is not None:
                hooks.on_pipeline(aten_gm, ctx)
        text = graph_text(aten_gm, ctx) if ctx.options.dump_dir is not None else None
        spec = ProgramSpec(ctx.signature, ep_layers(ctx), text, tuple(ctx.comm))
        if save is not None:
            save(Artifact(save_graph(aten_gm), spec))
        handoff = _handoff(spec, ctx.local_inputs(aten_gm), ctx.fake_mode, build)
        compiled = build.target.compile(aten_gm, handoff)
        return _bind(compiled, spec, captured, build)

    try:
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=compile_rank,
            inference_compiler=compile_rank,
            keep_inference_input_mutations=True,  # the cache writes stay in the graph
        )
    except GuardOnDataDependentSymNode as error:
        # Dynamo traced T as a backed size, where the op's branch on T passed; which op
        # branches is found by running the graph again on the symbolic inputs
        explained = branches_on_tokens(gm, captured.symbolic_inputs(captured.fakes))
        if explained is None:
            raise
        raise explained from error
    finally:
        kinds.close()


def _shared_key(captured: Captured, build: _Build) -> str | None:
    """The host cache key of this compile, or None when it is not shared
    (`runtime.host_cache`)."""
    opts, mesh = build.options, build.mesh
    hooks = active()
    tags = tuple(p.cache_tag for h in hooks for p in h.extra_passes)
    watched = any(h.stop_after or h.after_pass or h.on_pipeline for h in hooks)
    if not opts.share_compile or opts.dump_after or None in tags or watched:
        return None  # the pipeline must run here
    parts = (opts.cache_key(), mesh.world_size, mesh.tp, mesh.ep, mesh.device_type)
    parts += (build.target.name, captured.adapter.name, tags)
    dumps = opts.dump_dir is not None  # an artifact holds its graph's text only then
    return program_key(captured.gm, captured.fakes, (*parts, dumps))


def _load(artifact: Artifact, captured: Captured, build: _Build) -> ShardedProgram:
    """The program another rank of the host compiled, bound to this rank: no AOTAutograd, no
    pipeline; inductor finds its kernels in its caches. The graph keeps the model's cache
    writes (AOTAutograd's `keep_inference_input_mutations`) and aliases no input, so the
    program is called with Dynamo's inputs as they are."""
    gm = load_graph(artifact.graph)
    fake_mode = TracingContext.get().fake_mode
    model = captured.symbolic_inputs(captured.fakes)
    loaded = build.options.checkpoint is not None
    local = artifact.spec.signature.local_fakes(model, fake_mode, loaded=loaded)
    handoff = _handoff(artifact.spec, local, fake_mode, build)
    return _bind(build.target.compile(gm, handoff), artifact.spec, captured, build)


def _handoff(spec: ProgramSpec, local: list[Any], fake_mode: Any, build: _Build) -> Handoff:
    """What the target gets: the fake values of the program's inputs at their local shapes
    (`core.signature`), and which of them are weights."""
    return Handoff(
        build.target.name, local, spec.signature.param_indices, fake_mode, build.options,
        build.mesh.rank,
    )  # fmt: skip


def _context(
    aten_gm: GraphModule, aten_inputs: list[Any], captured: Captured, build: _Build
) -> CompileContext:
    placeholders = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    inputs = captured.inputs
    expected = len(inputs.param_fqns) + len(inputs.input_names)
    if len(placeholders) != expected:
        raise InternalError(f"the AOT graph has {len(placeholders)} inputs, Dynamo's {expected}")
    # "auto" cuts decided for this model's sizes: the passes see the options they chose.
    params = {fqn: placeholders[i].meta["val"] for i, fqn in inputs.param_fqns.items()}
    opts, choices = captured.adapter.resolve(build.options, params)
    return CompileContext(
        mesh=build.mesh,
        options=opts,
        adapter=captured.adapter,
        plan=captured.adapter.plan(opts),
        choices=choices,
        target=build.target.name,
        param_fqns={placeholders[i].name: fqn for i, fqn in inputs.param_fqns.items()},
        buffers=frozenset(placeholders[i].name for i in inputs.buffers),
        input_sources={placeholders[i].name: name for i, name in inputs.input_names.items()},
        token_input=placeholders[captured.token_index].name,
        fake_mode=detect_fake_mode(aten_inputs),
    )


def _bind(
    compiled: Callable[..., Any], spec: ProgramSpec, captured: Captured, build: _Build
) -> ShardedProgram:
    """The program of this rank: its weights read (the `checkpoint` option), its dumps
    written, its hooks called."""
    opts, mesh = build.options, build.mesh
    weights = None
    if opts.checkpoint is not None:
        weights = rank_weights(
            captured.adapter, opts.checkpoint, spec.signature, mesh,
            skip_unimplemented_parts=opts.skip_unimplemented_parts,
        )  # fmt: skip
    on_ep_stats = None
    if opts.dump_dir is not None:
        if spec.text is None:
            raise InternalError("a program compiled without its graph text is asked to dump it")
        layers = list(spec.ep_layers)
        out = write_dump(opts.dump_dir, mesh, opts, spec.text, list(spec.comm), layers)
        if layers:
            on_ep_stats = EpStepLog(out / "comm.json", layers, mesh.rank)
    program = ShardedProgram.for_mesh(
        compiled, spec, mesh, on_ep_stats=on_ep_stats, check_inputs=opts.check_inputs,
        weights=weights,
    )  # fmt: skip
    for hooks in active():
        if hooks.on_program is not None:
            hooks.on_program(program)
    return program
