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

from typing import Any

import torch
from torch._dynamo.backends.registry import register_backend
from torch._functorch.aot_autograd import aot_module_simplified
from torch._guards import detect_fake_mode
from torch.fx import GraphModule

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.hooks import active
from dsv41_compile.core.mesh import Mesh, build_mesh
from dsv41_compile.core.passes import PassManager
from dsv41_compile.frontend import (
    GraphInputs,
    check_whole_model,
    generalize_token_count,
    read_inputs,
)
from dsv41_compile.models import adapter_for
from dsv41_compile.options import BackendOptions
from dsv41_compile.pipeline import PIPELINE
from dsv41_compile.report.comm import comm_records
from dsv41_compile.report.dump import EpStepLog, graph_text, write_dump, write_graph
from dsv41_compile.runtime.program import ProgramSpec, ShardedProgram
from dsv41_compile.targets import compile_graph

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
    adapter = adapter_for(inputs.param_fqns.values(), inputs.input_names.values())
    check_whole_model(gm, adapter)
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    device_type = tensors[0].device.type if tensors else "cpu"
    # Meta tensors: planning only (`planning.plan_rank`), nothing runs; the mesh lives on CPU.
    planning = device_type == "meta"
    target = opts.target("cpu" if planning else device_type)
    if target == "torchair" and not planning:
        from dsv41_compile.targets.torchair import import_torchair

        import_torchair()  # fail before compiling when torch_npu is missing
    mesh = build_mesh(tp=opts.tp, ep=opts.ep, device_type="cpu" if planning else device_type)
    gm, example_inputs = generalize_token_count(gm, example_inputs, inputs, adapter)

    def compile_rank(aten_gm: GraphModule, aten_inputs: list[Any]) -> Any:
        ctx = _context(aten_gm, aten_inputs, inputs, opts, mesh, adapter, target)
        PASSES.run(aten_gm, ctx)
        for hooks in active():
            if hooks.on_pipeline is not None:
                hooks.on_pipeline(aten_gm, ctx)
        program = _lower(aten_gm, ctx)
        for hooks in active():
            if hooks.on_program is not None:
                hooks.on_program(program, ctx)
        return program

    return aot_module_simplified(
        gm, example_inputs, fw_compiler=compile_rank, inference_compiler=compile_rank
    )


def _context(
    aten_gm: GraphModule,
    aten_inputs: list[Any],
    inputs: GraphInputs,
    opts: BackendOptions,
    mesh: Mesh,
    adapter: Any,
    target: str,
) -> CompileContext:
    placeholders = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    expected = len(inputs.param_fqns) + len(inputs.input_names)
    if len(placeholders) != expected:
        raise InternalError(f"the AOT graph has {len(placeholders)} inputs, Dynamo's {expected}")
    param_fqns = {placeholders[i].name: fqn for i, fqn in inputs.param_fqns.items()}
    input_sources = {placeholders[i].name: name for i, name in inputs.input_names.items()}
    token = inputs.index_of(adapter.token_inputs[0])
    if token is None:
        raise ValueError(
            f"dsv41_sp expects the {adapter.name} model's inputs "
            f"{', '.join(adapter.token_inputs)}: no input named {adapter.token_inputs[0]} among "
            f"{sorted(set(input_sources.values()))}"
        )
    return CompileContext(
        mesh=mesh,
        options=opts,
        adapter=adapter,
        plan=adapter.plan(opts),
        target=target,
        param_fqns=param_fqns,
        input_sources=input_sources,
        token_input=placeholders[token].name,
        fake_mode=detect_fake_mode(aten_inputs),
    )


def _lower(gm: GraphModule, ctx: CompileContext) -> ShardedProgram:
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    spec = ProgramSpec(
        param_shards=dict(ctx.param_shards),
        token_index=placeholders.index(ctx.token_input),
        ep_layers=tuple(ctx.ep_layers),
        ep_tokens_input="ep_tokens" in placeholders,
    )
    on_ep_stats = None
    if ctx.options.dump_dir is not None:
        comm = ctx.comm or comm_records(gm, ctx)
        out = write_dump(
            ctx.options.dump_dir, ctx.mesh, ctx.options, graph_text(gm, ctx), comm, ctx.ep_layers
        )
        if ctx.ep_layers:
            on_ep_stats = EpStepLog(out / "comm.json", ctx.ep_layers, ctx.mesh.rank)
    return ShardedProgram.for_mesh(compile_graph(gm, ctx), spec, ctx.mesh, on_ep_stats=on_ep_stats)
