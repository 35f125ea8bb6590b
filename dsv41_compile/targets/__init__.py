"""Targets: the compiler a per-rank graph is handed to.

`eager` runs the FX graph as Python; `inductor` re-traces it with inductor's decompositions
(`compile_fx`), which schedules the functional collectives like any other op, under the host's
compile lock (`targets.inductor`); `npugraph_ex` hands it to torch_npu's npugraph_ex, which
captures each step as an ACL graph on Ascend NPUs (`targets.npugraph_ex`), after the model's
rewrites to torch_npu's kernels (`npu_ops`) and a check that a capture can replay it
(`capture_check`); `torchair` hands it to torchair's GE graph mode (`targets.torchair`), after
its own pass, `graph_mode`, has rewritten it.

A target needs the graph, fake values of its inputs (local shapes) and which inputs are
weights: a `Handoff`, from the program's signature (`core.signature`) where the pipeline ran or
where a program another rank of the host compiled is loaded (`runtime.host_cache`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.fx import GraphModule

from dsv41_compile.core.passes import Pass
from dsv41_compile.options import Lowering, register_lowering
from dsv41_compile.targets.base import Handoff, Target
from dsv41_compile.targets.capture_check import capture_check
from dsv41_compile.targets.inductor import compile_inductor
from dsv41_compile.targets.npu_passes import graph_mode, npu_ops
from dsv41_compile.targets.npugraph_ex import import_npugraph_ex, lower_npugraph_ex
from dsv41_compile.targets.torchair import import_torchair, lower_torchair

__all__ = ["TARGETS", "Handoff", "Target", "register_target"]


def _eager(gm: GraphModule, handoff: Handoff) -> Callable[..., Any]:
    return gm.forward


def _inductor(gm: GraphModule, handoff: Handoff) -> Callable[..., Any]:
    return compile_inductor(gm, handoff.example_inputs)


TARGETS: dict[str, Target] = {}
"""The lowerings `BackendOptions.target` resolves to, by name (`register_target`)."""


def register_target(target: Target) -> None:
    """Make `target` a lowering: its name a value of the `lowering` option, its needs checked
    by the options (`options.register_lowering`), its passes run by the pipeline."""
    TARGETS[target.name] = target
    register_lowering(target.lowering)


for _target in (
    Target(Lowering("eager"), _eager),
    Target(Lowering("inductor", auto_for=("cpu", "cuda")), _inductor),
    Target(
        Lowering("torchair", whole_graph="torchair's GE graphs", fused_ops=True),
        lower_torchair,
        passes=(Pass("graph_mode", graph_mode),),
        available=import_torchair,
    ),
    Target(
        Lowering(
            "npugraph_ex", auto_for=("npu",), whole_graph="a captured ACL graph", fused_ops=True
        ),
        lower_npugraph_ex,
        passes=(Pass("npu_ops", npu_ops), Pass("capture_check", capture_check)),
        available=import_npugraph_ex,
    ),
):
    register_target(_target)
