"""Every private torch API dsv41_compile uses, imported here and nowhere else in the package.

torch keeps much of what a compiler backend needs behind private names: Dynamo's backend
registry and restart signal, AOTAutograd's entry, the fake-tensor mode and the tracing
context, DTensor's sharding propagator and its spec types, the higher-order ops of compiled
regions, the FX graph pickler. A torch upgrade that moves one breaks this module, at import,
and `tests/core/test_torch_private.py` says which name -- not a pass in the middle of a
compile. `CHECKED_WITH` is the torch these names were checked against (the pinned one);
inductor's modules are imported on first use, as torch does (they are slow to import). The
shipped test helpers' one private import, torch's own test helpers, is
`testing.torch_shims`'s: the library never imports torch's test helpers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._C._distributed_c10d import (
    FakeProcessGroup,
    _register_process_group,
    _unregister_process_group,
)
from torch._dispatch.python import enable_python_dispatcher
from torch._dynamo.backends.registry import register_backend
from torch._dynamo.decorators import mark_unbacked
from torch._dynamo.exc import TensorifyScalarRestartAnalysis
from torch._dynamo.symbolic_convert import TensorifyState
from torch._dynamo.utils import counters as dynamo_counters
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
from torch._guards import CompileContext as DynamoCompileContext
from torch._guards import TracingContext, detect_fake_mode, tracing
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.fx._graph_pickler import GraphPickler
from torch.fx._graph_pickler import Options as GraphPicklerOptions
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only
from torch.utils._sympy.functions import FloorDiv
from torch.utils._sympy.functions import Max as SympyMax
from torch.utils._sympy.functions import Min as SympyMin

__all__ = [
    "CHECKED_WITH",
    "DTensorSpec",
    "DynamoCompileContext",
    "FakeProcessGroup",
    "FakeTensorMode",
    "FloorDiv",
    "GraphPickler",
    "GraphPicklerOptions",
    "OpOverload",
    "OpSchema",
    "SympyMax",
    "SympyMin",
    "TensorMeta",
    "TensorifyScalarRestartAnalysis",
    "TensorifyState",
    "TracingContext",
    "aot_module_simplified",
    "auto_functionalized_v2",
    "compile_fx",
    "detect_fake_mode",
    "dynamo_counters",
    "enable_python_dispatcher",
    "inductor_cache_dir",
    "invoke_subgraph",
    "is_fake",
    "make_boxed_func",
    "mark_unbacked",
    "on_dynamo_compiles",
    "recompile_limit",
    "register_backend",
    "replace_meta_kernel",
    "register_process_group",
    "sharding_propagator",
    "tracing",
    "tree_leaves",
    "tree_map",
    "tree_map_only",
    "unregister_process_group",
    "unset_fake_temporarily",
]

CHECKED_WITH = "2.13.0"
"""The torch release every name here was checked against."""

register_process_group = _register_process_group
unregister_process_group = _unregister_process_group


def replace_meta_kernel(op: OpOverload, kernel: Any) -> Callable[[], None]:
    """Make `kernel` what fake and meta tensors run for `op` -- torch's table of Python meta
    kernels (`torch._decomp.meta_table`, which fake tensors ask before an op's decomposition)
    and the op's Python `Meta` kernel (what the Python dispatcher runs) -- and return the
    function that puts torch's back."""
    from torch._decomp import meta_table

    key = torch._C.DispatchKey.Meta
    saved_table, saved_kernel = meta_table.get(op), op.py_kernels.get(key)

    def install(table_kernel: Any, py_kernel: Any) -> None:
        if table_kernel is None:
            meta_table.pop(op, None)
        else:
            meta_table[op] = table_kernel
        op.py_kernels.pop(key, None)
        if py_kernel is not None:
            op.py_impl(key)(py_kernel)
        op._dispatch_cache.clear()

    install(kernel, kernel)
    return lambda: install(saved_table, saved_kernel)


def on_dynamo_compiles(start: Callable[[Any], None], end: Callable[[Any], None]) -> None:
    """Have Dynamo call `start` when it starts compiling a frame (before it traces) and `end`
    when that compile ends, the backend's work included (`torch._dynamo.callback_handler`);
    nothing when they are registered already. `torch._dynamo.reset()` unregisters them."""
    from torch._dynamo.callback import callback_handler

    if start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(start)
    if end not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(end)


def recompile_limit() -> int:
    """Dynamo's recompile limit per frame (`torch._dynamo.config.recompile_limit`)."""
    return torch._dynamo.config.recompile_limit


def sharding_propagator() -> Any:
    """DTensor's sharding propagator (its op rules)."""
    return DTensor._op_dispatcher.sharding_propagator


def compile_fx(gm: Any, example_inputs: list[Any], **config: Any) -> Any:
    """Inductor's `compile_fx`, with inductor's `config` patched for this compile."""
    from torch._inductor.compile_fx import compile_fx as inductor_compile_fx

    return inductor_compile_fx(gm, example_inputs, config_patches=config)


def inductor_cache_dir() -> str:
    """Inductor's cache directory (`TORCHINDUCTOR_CACHE_DIR` moves it)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()
