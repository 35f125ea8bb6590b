"""What a target is (`Target`: a name, the passes it needs, a compile function) and what it
receives (`Handoff`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.fx import GraphModule

from dsv41_compile.core.passes import Pass
from dsv41_compile.options import BackendOptions, Lowering

__all__ = ["Handoff", "Target", "needs_torch_npu"]


@dataclass(frozen=True)
class Handoff:
    """Everything a target receives besides the per-rank graph."""

    target: str
    example_inputs: list[Any]
    """Fake values of the graph's inputs, at their local shapes."""
    param_indices: frozenset[int]
    """The inputs that are the model's weights."""
    fake_mode: Any
    options: BackendOptions
    rank: int
    token_index: int
    """The position of the first token input (its dim 0 is the call's token count)."""


@dataclass(frozen=True)
class Target:
    """A lowering, whole: its name and needs (`lowering`, what the options check), the passes it
    needs, how to tell it can run here and how it compiles. `targets.register_target` makes it
    a value of the `lowering` option; nothing else names it."""

    lowering: Lowering
    compile: Callable[[GraphModule, Handoff], Callable[..., Any]]
    """`compile(gm, handoff)`: a callable taking the graph's inputs."""
    passes: tuple[Pass, ...] = ()
    """What this target needs done to the per-rank graph: run after the pipeline's rewrites,
    before verify checks the result (`pipeline.passes`)."""
    available: Callable[[], Any] | None = None
    """Raises a ValueError saying what to install when its compiler is missing (called before
    a compile that will run, not when planning); None: always available."""

    @property
    def name(self) -> str:
        return self.lowering.name


def needs_torch_npu(lowering: str, where: str) -> str:
    """The message of an NPU lowering whose torch_npu is missing: what to install, where (not
    without CANN), and what to use instead. `where`: how the lowering's backend ships in it."""
    return (
        f"lowering='{lowering}' needs torch_npu ({where}): on a machine with the Ascend CANN "
        "toolkit, `pip install 'dsv41-compile[npu]'` (torch_npu==2.13.*). Without CANN, "
        "installing torch_npu breaks `import torch`; use lowering='eager' or 'inductor' there"
    )
