"""Every private torch API dsv41_compile uses, imported here and nowhere else in the package.

torch keeps much of what a compiler backend needs behind private names: Dynamo's backend
registry, restart signal and compile callbacks, AOTAutograd's entry, the fake-tensor mode and
the tracing context, DTensor's sharding propagator and its spec types, the higher-order ops of
compiled regions, the FX graph pickler, the attributes of an op (`_schema`, `_opname`), of a
process group (its timeout), of a tensor (its version counter); and the internals of symbolic
sizes: a `SymInt`'s `SymNode` (its sympy expression, its hint, its shape env) and the shape
env's own state (unbacked symbols, guards, replacements, deferred asserts), which the rest of
the package reaches through the functions below. A torch upgrade that moves one breaks this module, at import,
and `tests/core/test_torch_private.py` says which name -- not a pass in the middle of a
compile. `CHECKED_WITH` is the torch these names were checked against (the pinned one);
inductor's modules are imported on first use, as torch does (they are slow to import). The
shipped test helpers' one private import, torch's own test helpers, is
`testing.torch_shims`'s: the library never imports torch's test helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import sympy
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
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorMode,
    is_fake,
    unset_fake_temporarily,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.fx._graph_pickler import GraphPickler
from torch.fx._graph_pickler import Options as GraphPicklerOptions
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only
from torch.utils._sympy.functions import FloorDiv
from torch.utils._sympy.functions import Max as SympyMax
from torch.utils._sympy.functions import Min as SympyMin

__all__ = [
    "CHECKED_WITH",
    "DTensorSpec",
    "DynamoCompileContext",
    "dynamo_config",
    "new_unbacked_symbols_dropped",
    "FakeProcessGroup",
    "FakeTensor",
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
    "TorchDispatchMode",
    "TracingContext",
    "add_guard",
    "aot_module_simplified",
    "auto_functionalized_v2",
    "backed_values",
    "call_kernel_for",
    "compile_fx",
    "custom_op_overload",
    "destroy_library",
    "detect_fake_mode",
    "dynamo_counters",
    "enable_python_dispatcher",
    "equalities",
    "has_kernel_for",
    "shape_env_guards",
    "inductor_cache_dir",
    "inherit_timeout",
    "invoke_subgraph",
    "is_fake",
    "make_boxed_func",
    "mark_unbacked",
    "new_input_size",
    "on_dynamo_compiles",
    "op_short_name",
    "op_schema",
    "overload_name",
    "recompile_limit",
    "register_backend",
    "register_fake_backend",
    "register_process_group",
    "rename_node",
    "replace_meta_kernel",
    "sharding_propagator",
    "size_of",
    "sym_expr",
    "sym_hint",
    "sym_shape_env",
    "tracing",
    "tree_leaves",
    "tree_map",
    "tree_map_only",
    "unregister_process_group",
    "unset_fake_temporarily",
    "version_counter",
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


def sym_expr(size: torch.SymInt | torch.SymFloat | torch.SymBool) -> sympy.Expr:
    """The sympy expression of a symbolic size (its `SymNode`'s)."""
    return size.node.expr


def sym_hint(size: torch.SymInt | torch.SymFloat | torch.SymBool) -> int | float | bool | None:
    """The example value of a symbolic size, None for an unbacked one."""
    return size.node.hint


def sym_shape_env(size: torch.SymInt) -> ShapeEnv:
    """The shape env a symbolic size belongs to."""
    return size.node.shape_env


def new_input_size(shape_env: ShapeEnv) -> torch.SymInt:
    """A fresh unbacked size of `shape_env` for an input (not an op's output: the shape env
    does not expect an op to have bound it)."""
    with shape_env.ignore_fresh_unbacked_symbols():
        return shape_env.create_unbacked_symint()


def size_of(shape_env: ShapeEnv, expr: sympy.Expr) -> int | torch.SymInt:
    """A symbolic size of `shape_env` for `expr`, without a hint (an int when `expr` is a
    number)."""
    return shape_env.create_symintnode(expr, hint=None)


def shape_env_guards(shape_env: ShapeEnv) -> list[Any]:
    """The guards `shape_env` has recorded, in order (each with its `expr`)."""
    return shape_env.guards


def add_guard(shape_env: ShapeEnv, expr: sympy.Expr) -> None:
    """Make `expr` (over the shape env's symbols) hold: a guard of the frame."""
    shape_env.evaluate_expr(expr)


def backed_values(shape_env: ShapeEnv) -> Mapping[sympy.Symbol, int]:
    """The example values of the shape env's backed symbols."""
    return shape_env.backed_var_to_val


def equalities(shape_env: ShapeEnv) -> Iterator[tuple[sympy.Expr, sympy.Expr]]:
    """The pairs of expressions the shape env found equal: its replacements, and the
    equalities it deferred as runtime asserts."""
    yield from shape_env.replacements.items()
    for asserts in shape_env.deferred_runtime_asserts.values():
        for ra in asserts:
            if isinstance(ra.expr, sympy.Eq):
                yield ra.expr.args[0], ra.expr.args[1]


def op_schema(op: OpOverload) -> torch.FunctionSchema:
    """An op's schema."""
    return op._schema


def op_short_name(op: OpOverload) -> str:
    """An op's name without its namespace and overload (`all_gather_into_tensor`)."""
    return op._opname


def overload_name(op: OpOverload) -> str:
    """An op overload's name (`default`, `Tensor`)."""
    return op._overloadname


def has_kernel_for(op: OpOverload, dispatch_key: str) -> bool:
    """Whether the dispatcher holds a kernel of `op` for `dispatch_key` ("PrivateUse1": a
    device backend's, torch_npu's on NPUs; "CompositeExplicitAutograd": one written in other
    ops)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), dispatch_key)


def call_kernel_for(op: OpOverload, dispatch_key: str, *args: Any, **kwargs: Any) -> Any:
    """`op`'s kernel for `dispatch_key` called directly (the ops it calls dispatch as usual)."""
    return op._op_dk(getattr(torch._C.DispatchKey, dispatch_key), *args, **kwargs)


def custom_op_overload(op: Any) -> OpOverload:
    """The `OpOverload` of a `torch.library.custom_op`-decorated function."""
    return op._opoverload


def destroy_library(library: torch.library.Library) -> None:
    """Unregister everything `library` defined (its ops, its kernels)."""
    library._destroy()


def version_counter(tensor: torch.Tensor) -> int:
    """The tensor's version counter (bumped by every in-place write)."""
    return tensor._version


def inherit_timeout(group: Any, world: Any, device_type: str) -> None:
    """Give process group `group` the timeout of `world` (on `device_type`'s backend), when
    the world's backend has options (a fake process group has none)."""
    import torch.distributed as dist

    backend = world._get_backend(torch.device(device_type))
    options = getattr(backend, "options", None)
    if options is not None:
        dist.distributed_c10d._set_pg_timeout(options._timeout, group)


def register_fake_backend() -> None:
    """Register torch's `fake` process group as the c10d backend "fake" (every collective a
    no-op), once."""
    import torch.distributed as dist

    def create(common_opts: Any, backend_opts: Any) -> Any:
        # torch's stub omits `options`, which the binding takes (torch's own fake_pg passes it)
        return FakeProcessGroup._create_internal(  # type: ignore[call-arg]
            common_opts.group_rank, common_opts.group_size, backend_opts
        )

    if "fake" not in dist.Backend._plugins:
        dist.Backend.register_backend("fake", create, extended_api=True, devices=["cpu", "cuda"])


def rename_node(node: Any, name: str) -> None:
    """Give an FX node another name (FX makes it unique in its graph)."""
    node._rename(name)


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


@contextmanager
def new_unbacked_symbols_dropped() -> Iterator[None]:
    """Run the block, then forget the unbacked symbols the active fake mode's shape env made in
    it and no traced output claimed (`ShapeEnv.pending_fresh_unbacked_symbols`, which fake
    propagation checks after each node): what a question asked on fake values made."""
    mode = detect_fake_mode()
    pending = mode.shape_env.pending_fresh_unbacked_symbols if mode and mode.shape_env else []
    before = len(pending)
    try:
        yield
    finally:
        del pending[before:]


def dynamo_config(**settings: Any) -> Any:
    """A context in which Dynamo's config has `settings` (`torch._dynamo.config.patch`)."""
    return torch._dynamo.config.patch(**settings)
