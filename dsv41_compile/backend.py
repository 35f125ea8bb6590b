"""The `dsv41_sp` torch.compile backend.

    compiled = torch.compile(model, backend="dsv41_sp", options={"tp": 4, "ep": 8})

A compile, in order: the options read; the front porch's capture (`frontend.capture`: what
Dynamo's graph is, its model family and that family's options, checked); how this rank builds
(its mesh, its target); then, once per host (`runtime.host_cache.claim`), the front
porch's trace (`frontend.trace`: the flat ATen inference graph), the pipeline (`pipeline.py`:
place, communicate, localize, verify) and the target (`targets`); `runtime.program.
ShardedProgram` runs the result per call. Every rank compiles the same graph -- the rank
enters as the `tp_rank` input -- so one rank per host compiles it and the others load it,
skipping everything after `capture`. Nothing below calls back into this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.fx import GraphModule

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.hooks import active, pass_manager
from dsv41_compile.core.mesh import Mesh, build_mesh
from dsv41_compile.core.registry import code_fingerprint
from dsv41_compile.core.torch_private import (
    TracingContext,
    detect_fake_mode,
    register_backend,
)
from dsv41_compile.frontend import (
    Captured,
    Traced,
    capture,
    computes_no_tensor,
    hold_during_dynamo_compiles,
    trace,
)
from dsv41_compile.frontend.tokens import mark_token_dim
from dsv41_compile.moe.stats import ep_layers
from dsv41_compile.options import BackendOptions
from dsv41_compile.pipeline import check_dump_after, passes
from dsv41_compile.report.dump import EpStepLog, graph_text, write_dump, write_graph
from dsv41_compile.runtime.host_cache import Artifact, claim, load_graph, program_key, save_graph
from dsv41_compile.runtime.program import ProgramSpec, ShardedProgram
from dsv41_compile.runtime.weights import rank_weights
from dsv41_compile.spmd.rules import RULES
from dsv41_compile.spmd.transitions import TRANSITIONS
from dsv41_compile.targets import TARGETS, Handoff, Target

__all__ = ["BackendOptions", "dsv41_sp", "mark_token_dim"]


@dataclass(frozen=True)
class _Build:
    """How this rank builds the program: its mesh and its target."""

    mesh: Mesh
    target: Target


@register_backend(name="dsv41_sp")
def dsv41_sp(
    gm: GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None
) -> Any:
    """The `dsv41_sp` backend. See `BackendOptions` for `options`."""
    opts = BackendOptions.from_dict(options)
    check_dump_after(opts)
    if computes_no_tensor(gm):  # Dynamo's graph before the model refused its batch
        return gm.forward
    captured = capture(gm, example_inputs, opts)
    build = _build(captured)
    with claim(None if captured.planning else _shared_key(captured, build), captured.fakes) as c:
        if c.loaded is not None:
            return _load(c.loaded, captured, build)
        return _compile(captured, build, c.save)


hold_during_dynamo_compiles()  # the front porch's meta kernels (frontend.meta_kernels)


def _build(captured: Captured) -> _Build:
    """This rank's mesh and target, and the family's check of the options against the model's
    parameter shapes."""
    opts = captured.options
    # Meta tensors: planning only (`planning.plan_rank`), nothing runs; the mesh lives on CPU.
    device_type = "cpu" if captured.planning else captured.device_type
    target = TARGETS[opts.target(device_type)]
    if not captured.planning and target.available is not None:
        target.available()  # fail before compiling when its compiler (torch_npu) is missing
    mesh = build_mesh(tp=opts.tp, ep=opts.ep, device_type=device_type)
    captured.adapter.check(opts, captured.param_shapes())
    return _Build(mesh, target)


def _compile(captured: Captured, build: _Build, save: Callable[[Artifact], None]) -> Any:
    """The front porch's trace, the pipeline and the target, on this rank; `save` receives
    the result for the host's other ranks."""
    traced = trace(captured, captured.adapter.decomposed(captured.options, build.target.lowering))
    ctx = _context(traced, captured, build)
    pass_manager(passes(build.target), write_graph=write_graph).run(traced.gm, ctx)
    for hooks in active():
        if hooks.on_pipeline is not None:
            hooks.on_pipeline(traced.gm, ctx)
    text = graph_text(traced.gm, ctx) if ctx.options.dump_dir is not None else None
    if ctx.signature is None:
        raise InternalError("the pipeline left the program without its signature (localize)")
    spec = ProgramSpec(ctx.signature, ep_layers(ctx), text, tuple(ctx.comm))
    save(Artifact(save_graph(traced.gm), spec))
    handoff = _handoff(spec, ctx.local_inputs(traced.gm), ctx.fake_mode, captured, build)
    compiled = build.target.compile(traced.gm, handoff)
    return traced.bind(_bind(compiled, spec, captured, build))


def _shared_key(captured: Captured, build: _Build) -> str | None:
    """The host cache key of this compile, or None when it is not shared
    (`runtime.host_cache`)."""
    opts, mesh = captured.options, build.mesh
    hooks = active()
    tags = tuple(p.cache_tag for h in hooks for p in h.extra_passes)
    watched = any(h.stop_after or h.after_pass or h.on_pipeline for h in hooks)
    if not opts.share_compile or opts.dump_after or None in tags or watched:
        return None  # the pipeline must run here
    parts: tuple[Any, ...] = (opts.cache_key(), mesh.world_size, mesh.tp, mesh.ep, mesh.device_type)
    # the op rules and transitions in force (a rule added or changed at run time plans
    # another program: `core.registry.code_fingerprint`)
    adapter_rules = code_fingerprint(captured.adapter.rules.items())
    rules = (RULES.fingerprint(), TRANSITIONS.fingerprint(), adapter_rules)
    parts += (build.target.name, captured.adapter.name, tags, rules)
    dumps = opts.dump_dir is not None  # an artifact holds its graph's text only then
    return program_key(captured.gm, captured.fakes, (*parts, dumps))


def _load(artifact: Artifact, captured: Captured, build: _Build) -> Any:
    """The program another rank of the host compiled, bound to this rank: no front porch
    trace, no pipeline; inductor finds its kernels in its caches. The graph keeps the model's
    cache writes (AOTAutograd's `keep_inference_input_mutations`) and aliases no input, so the
    program is called with Dynamo's inputs as they are."""
    gm = load_graph(artifact.graph)
    fake_mode = TracingContext.get().fake_mode
    model = captured.symbolic_inputs(captured.fakes)
    loaded = captured.options.checkpoint is not None
    local = artifact.spec.signature.local_fakes(model, fake_mode, loaded=loaded)
    handoff = _handoff(artifact.spec, local, fake_mode, captured, build)
    program = _bind(build.target.compile(gm, handoff), artifact.spec, captured, build)
    return lambda *args: program(list(args))


def _handoff(
    spec: ProgramSpec, local: list[Any], fake_mode: Any, captured: Captured, build: _Build
) -> Handoff:
    """What the target gets: the fake values of the program's inputs at their local shapes
    (`core.signature`), and which of them are weights."""
    return Handoff(
        build.target.name, local, spec.signature.param_indices, fake_mode, captured.options,
        build.mesh.rank, spec.signature.token_index,
    )  # fmt: skip


def _context(traced: Traced, captured: Captured, build: _Build) -> CompileContext:
    placeholders = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    inputs = captured.inputs
    expected = len(inputs.param_fqns) + len(inputs.input_names)
    if len(placeholders) != expected:
        raise InternalError(f"the AOT graph has {len(placeholders)} inputs, Dynamo's {expected}")
    # "auto" cuts decided for this model's sizes: the passes see the options they chose.
    params = {fqn: placeholders[i].meta["val"] for i, fqn in inputs.param_fqns.items()}
    opts, choices = captured.adapter.resolve(captured.options, params)
    fake_mode = detect_fake_mode(traced.inputs)
    if fake_mode is None:
        raise InternalError("AOTAutograd's graph inputs are not fake tensors")
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
        fake_mode=fake_mode,
        stage_seconds=dict(traced.stage_seconds),
        kinds_traced=traced.kinds_traced,
    )


def _bind(
    compiled: Callable[..., Any], spec: ProgramSpec, captured: Captured, build: _Build
) -> ShardedProgram:
    """The program of this rank: its weights read (the `checkpoint` option), its dumps
    written, its hooks called."""
    opts, mesh = captured.options, build.mesh
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
        weights=weights, check_batch=captured.adapter.check_inputs,
    )  # fmt: skip
    for hooks in active():
        if hooks.on_program is not None:
            hooks.on_program(program)
    return program
