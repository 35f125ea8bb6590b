"""The inductor target: `compile_fx` on the per-rank graph, one compile at a time per host.

Ranks on one host share inductor's cache directory. Compiling there concurrently is not safe:
two processes building the same kernel write the same shared library, and one can load the
file while the other still writes it ("file too short"). So every inductor compile of a
`dsv41_sp` program holds a host-wide lock (a file lock in the cache directory). With the
per-rank graph the same on every rank (`core.mesh` names the TP group alike everywhere), the
first rank compiles and the others find every kernel in inductor's caches.

Inductor keeps a fused kernel's intermediates in fp32 unless told to round where the graph
casts (`emulate_precision_casts`); the program rounds where the model does, so a bf16 model
(and the official numerics' FP8 / bf16 roundings) computes what the single-device model
computes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.fx import GraphModule

from dsv41_compile.core.torch_private import compile_fx
from dsv41_compile.runtime.host_cache import host_lock

__all__ = ["compile_inductor"]


def compile_inductor(gm: GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    with host_lock("inductor"):
        return compile_fx(gm, example_inputs, emulate_precision_casts=True)
