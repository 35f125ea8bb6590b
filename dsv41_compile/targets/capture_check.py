"""capture_check: the per-rank graph can be captured as one ACL graph (`lowering="npugraph_ex"`).

Requires: the rewritten per-rank graph, each node with its local value (`meta["val"]`).
Ensures: nothing; refuses (ValueError) a graph a capture cannot replay, naming each node, why,
and what to change:

- a **host read**: a tensor's value read on the host (`_local_scalar_dense`, `.item()`,
  `.tolist()`, a Python `if` on a tensor that Dynamo kept as a size): a replay runs on the
  device alone and would reuse the value read at capture;
- a **data-dependent size**: an op whose output size depends on tensor values (`nonzero`,
  `masked_select`, a split sized by counts read on the host): a capture fixes every size;
- a **tensor on another device** than the graph's inputs (a CPU constant): a capture records
  one device's kernels.

A size symbol made by a host read (an unbacked symbol) is reported where it is made, not at
every op whose size it then sets. The fix is the one the pass that made the node recorded
(`meta.CAPTURE_FIX`: the exact EP lowering's host reads name `ep_dispatch='padded'`), else the
general one, with the model's source line where the node has one.

Where torch_npu is in use, it also refuses an op without an NPU kernel
(`targets.npugraph_ex.check_npu_kernels`, from torch_npu's dispatcher; on CPU the same check
reads its registration file: `tools/torchair_coverage.py --lowering npugraph_ex`). It runs on
the rank that compiles; the host's other ranks load the checked program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.meta import CAPTURE_FIX, describe
from dsv41_compile.targets.npugraph_ex import check_npu_kernels, torch_npu_in_use

__all__ = ["CaptureProblem", "capture_check", "capture_problems"]

aten = torch.ops.aten
HOST_READS = frozenset(
    {
        aten._local_scalar_dense.default,
        aten.item.default,
        aten.is_nonzero.default,
        aten.equal.default,
    }
)
_FIXES = {
    "host read": "keep the value on the device: select with torch.where over an arange, "
    "index with a tensor (index_select, index_put), mask instead of branching",
    "data-dependent size": "give the op a size known before the values: a fixed upper "
    "bound padded with a mask (torch.where), or a tensor index instead of nonzero",
    "device": "make the tensor on the model's device (device=x.device)",
}


@dataclass(frozen=True)
class CaptureProblem:
    node: Node
    kind: str
    """"host read", "data-dependent size" or "device"."""
    detail: str

    def __str__(self) -> str:
        fix = self.node.meta.get(CAPTURE_FIX) or _FIXES[self.kind]
        return f"{describe(self.node)}: {self.kind} ({self.detail}); use {fix}"


def capture_problems(gm: GraphModule, device: torch.device) -> list[CaptureProblem]:
    """What a capture of `gm`, whose inputs live on `device`, cannot replay."""
    problems: list[CaptureProblem] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        if node.target in HOST_READS:
            problems.append(CaptureProblem(node, "host read", f"{node.target} reads a value"))
            continue
        made = free_unbacked_symbols(val) - _unbacked_of_inputs(node)
        if made:
            names = ", ".join(sorted(str(s) for s in made))
            problems.append(
                CaptureProblem(node, "data-dependent size", f"its output's size {names}")
            )
        for tensor in _tensors(val):
            if tensor.device != device:
                problems.append(
                    CaptureProblem(node, "device", f"a tensor on {tensor.device}, not {device}")
                )
                break
    return problems


def capture_check(gm: GraphModule, *, ctx: CompileContext) -> None:
    if torch_npu_in_use():  # the ops' NPU kernels, from torch_npu's dispatcher
        check_npu_kernels(gm)
    token = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == ctx.token_input)
    problems = capture_problems(gm, token.meta["val"].device)
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(
            f"lowering='{ctx.target}' captures each step as an ACL graph, which replays on the "
            f"device alone with the sizes of its capture; this graph has {len(problems)} "
            f"node(s) a capture cannot replay:\n{listed}\n"
            "(lowering='eager' runs such a graph uncaptured)"
        )


def _unbacked_of_inputs(node: Node) -> set[object]:
    found: set[object] = set()
    for arg in node.all_input_nodes:
        found |= free_unbacked_symbols(arg.meta.get("val"))
    return found


def _tensors(val: object) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return []
