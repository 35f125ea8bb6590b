"""The npugraph_ex lowering (Ascend NPU, ACL graph capture): the per-rank ATen graph goes to
torch_npu's npugraph_ex backend, `npugraph_ex.get_npu_backend(compiler_config=...)`, which
re-runs AOTAutograd on it (no decompositions but its two collectives), runs its graph passes,
and calls torch_npu's own kernels, captured into an ACL graph on the first call of each size
and replayed after (read from torch-npu 2.13.0's `torch_npu/dynamo/npugraph_ex/`; see
docs/backend.md, "The NPU lowerings").

What this target sets, and why:

- `frozen_parameter`: the weights keep their addresses (they are sliced once and reused,
  `ShardedProgram`), so a capture is keyed by the sizes alone, not by the weights' pointers;
  the weights go in as `nn.Parameter` (what npugraph_ex's AOT step marks as static inputs, never
  copied into the capture's buffers).
- `clone_output`: a replay writes its outputs in the capture's memory pool, where the next
  replay of that size overwrites them; serving keeps a step's logits past the next call
  (speculative decoding verifies against them), so they are copied out.
- Steps of at most `capture_tokens` tokens (decode, verify) are captured, one ACL graph per
  token count (`capture_limit` set above that count, so npugraph_ex never drops its captures and
  falls back to eager); longer steps (prefill) run the same graph uncaptured
  (`force_eager=True`), as the field serves prefill.
- Not set: `static_kernel_compile`. Its first call of each graph gathers over all of a
  node's ranks (a gloo group of its own), which every local rank must reach together; a DP
  group's programs differ from the other group's (an idle group's T = 0 graph), so they do not.

Before the hand-off this target's passes have run: the model's own rewrites to torch_npu's
kernels (`npu_ops`: DeepSeek V4.1's routed experts through the grouped matmul, its FP8 / FP4
formats through the MX ops) and the capture check (`targets.capture_check`): no host read, no
data-dependent size, one device; and, where torch_npu is in use, every op with an NPU kernel
(`check_npu_kernels`, on the rank that compiles: a program another rank of the host compiled is
loaded without its nodes' values, and was checked there). Status: checked on
CPU only, through `testing.npugraph_ex_standin`; nothing here has run on an NPU
(`tools/npu_smoke.py --lowering npugraph_ex` is the hardware check).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import GraphModule
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.fx.node import map_arg

from dsv41_compile.core.hooks import active
from dsv41_compile.core.torch_private import (
    OpOverload,
    TorchDispatchMode,
    call_kernel_for,
    has_kernel_for,
    tree_map,
)
from dsv41_compile.options import BackendOptions
from dsv41_compile.targets.base import Handoff, needs_torch_npu

__all__ = [
    "ANY_DEVICE",
    "COMPOSITE",
    "check_npu_kernels",
    "compiler_config",
    "import_npugraph_ex",
    "lower_npugraph_ex",
    "npu_kernel_gaps",
    "torch_npu_in_use",
]

INSTALL = needs_torch_npu(
    "npugraph_ex", "npugraph_ex ships in it, importable as `npugraph_ex` once torch_npu is imported"
)
COMPOSITE = ("CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")
"""The dispatch keys of kernels written in other ops: such an op runs on NPU tensors when the
ops its kernel calls do."""
ANY_DEVICE = ("prim", "_c10d_functional")
"""Namespaces whose ops run on any device: metadata (`prim.device`) and the functional
collectives (they call the process group's backend, HCCL on NPUs)."""


def import_npugraph_ex() -> Any:
    """`npugraph_ex` (or the stand-in an installed hook supplies), or a ValueError that says
    what to install."""
    for hooks in reversed(active()):
        if hooks.npugraph_ex is not None:
            return hooks.npugraph_ex
    try:
        importlib.import_module("torch_npu")  # first: it registers the `npugraph_ex` module
        return importlib.import_module("npugraph_ex")
    except ImportError as error:
        raise ValueError(f"{INSTALL} ({error})") from None


def compiler_config(npugraph_ex: Any, options: BackendOptions, *, captured: bool) -> Any:
    """npugraph_ex's `CompilerConfig` for the captured steps (`captured`) or the uncaptured
    ones (module docstring)."""
    config = npugraph_ex.CompilerConfig()
    config.frozen_parameter = True
    config.clone_output = True
    # one capture per token count up to capture_tokens, T = 0 included: never past the limit
    config.capture_limit = options.capture_tokens + 1
    config.force_eager = not captured
    return config


def npu_kernel_gaps(
    gm: GraphModule, has_kernel: Callable[[OpOverload], bool]
) -> dict[str, list[str]]:
    """The ops of `gm` that cannot run on NPU tensors, each with the nodes that call it.
    `has_kernel(op)`: torch_npu holds a kernel of its own for `op`. An op without one whose
    kernel is a composite (`COMPOSITE`: written in other ops, as most functional forms of an
    `out=` op are) runs where the ops it calls run: the kernel is run once on meta tensors of
    the node's sizes and each op it calls is checked the same way; a gap is then named through
    it (`aten.frexp.Tensor -> aten.frexp.Tensor_out`). A view needs no kernel."""
    gaps: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, OpOverload):
            continue
        args, kwargs = map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        for missing in dict.fromkeys(_missing(node.target, args, kwargs, has_kernel, depth=0)):
            gaps.setdefault(missing, []).append(node.name)
    return gaps


def _missing(
    op: OpOverload, args: Any, kwargs: Any, has_kernel: Callable[[OpOverload], bool], depth: int
) -> list[str]:
    if op.namespace in ANY_DEVICE or op.is_view or has_kernel(op):
        return []  # a view: new metadata over the same storage, on any device
    key = next((k for k in COMPOSITE if has_kernel_for(op, k)), None)
    if key is None or depth == 4:
        return [str(op)]
    missing = []
    for called, a, k in _calls_of(op, key, args, kwargs):
        missing += [f"{op} -> {m}" for m in _missing(called, a, k, has_kernel, depth + 1)]
    return missing


def _calls_of(op: OpOverload, key: str, args: Any, kwargs: Any) -> list[tuple[Any, Any, Any]]:
    """The ops `op`'s kernel for dispatch key `key` calls, in order, run on meta tensors of the
    values' dtypes and (hinted) sizes: a composite kernel may touch a fake tensor's data."""
    calls: list[tuple[Any, Any, Any]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            calls.append((func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    args, kwargs = tree_map(_on_meta, (args, kwargs))
    with Record(), contextlib.suppress(NotImplementedError):
        # an op it calls without a meta kernel stops it there: that op is the last recorded
        # (torch_npu's `_cummax_helper`, which `cummax.out` calls: the kernel's last op)
        call_kernel_for(op, key, *args, **kwargs)
    return calls


def _on_meta(value: Any) -> Any:
    """A value with concrete sizes (a symbolic one's hint, 8 for a token count of no hint),
    tensors as meta tensors."""
    if isinstance(value, torch.SymInt):
        return optimization_hint(value, fallback=8)
    if isinstance(value, torch.Tensor):
        size = [optimization_hint(s, fallback=8) for s in value.shape]
        return torch.empty(size, dtype=value.dtype, device="meta")
    return value


def _dispatcher_has_npu_kernel(op: OpOverload) -> bool:
    """Whether torch's dispatcher (torch_npu imported) holds an NPU kernel of `op`."""
    return has_kernel_for(op, "PrivateUse1")


def torch_npu_in_use() -> bool:
    """Whether the ops run on torch_npu itself: it is imported, and no stand-in replaces
    npugraph_ex (`testing.npugraph_ex_standin`)."""
    return "torch_npu" in sys.modules and not any(h.npugraph_ex is not None for h in active())


def check_npu_kernels(gm: GraphModule) -> None:
    """A ValueError naming the ops of `gm` (each node carrying its value) torch_npu's dispatcher
    has no NPU kernel for (`npu_kernel_gaps`)."""
    gaps = npu_kernel_gaps(gm, _dispatcher_has_npu_kernel)
    if gaps:
        listed = "; ".join(f"{op} ({', '.join(nodes[:3])})" for op, nodes in sorted(gaps.items()))
        raise ValueError(
            f"lowering='npugraph_ex': torch_npu has no NPU kernel for {listed}. Change the "
            "model so it does not call them, or use lowering='eager' to run elsewhere; "
            "tools/torchair_coverage.py --lowering npugraph_ex lists them for any preset"
        )


def lower_npugraph_ex(gm: GraphModule, handoff: Handoff) -> Callable[..., Any]:
    """The per-rank graph compiled by npugraph_ex twice: captured (steps of at most
    `capture_tokens` tokens) and uncaptured (longer steps); each call takes the one its token
    count selects."""
    npugraph_ex = import_npugraph_ex()
    inputs = list(handoff.example_inputs)
    with handoff.fake_mode:  # weights as nn.Parameter: static inputs of the captures
        for index in handoff.param_indices:
            inputs[index] = torch.nn.Parameter(inputs[index], requires_grad=False)
    options = handoff.options
    captured = npugraph_ex.get_npu_backend(
        compiler_config=compiler_config(npugraph_ex, options, captured=True)
    )(gm, inputs)
    uncaptured = npugraph_ex.get_npu_backend(
        compiler_config=compiler_config(npugraph_ex, options, captured=False)
    )(gm, inputs)
    token, limit = handoff.token_index, options.capture_tokens

    def run(*args: Any) -> Any:
        return (captured if args[token].shape[0] <= limit else uncaptured)(*args)

    return run
