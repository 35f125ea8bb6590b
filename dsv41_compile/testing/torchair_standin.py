"""A CPU stand-in for torchair, for tests and `tools/torchair_coverage.py` (torch_npu cannot be
installed without the Ascend toolkit).

It replaces the one entry point the torchair lowering calls, `get_npu_backend(compiler_config=)`,
and the config it builds, with the attribute paths of torch-npu 2.13.0's `CompilerConfig`
(configs/compiler_config.py, experimental_config.py, debug_config.py; setting any other
attribute is an error, as in torchair). Its backend records what it is handed and then does what
torchair's does before converting to GE (npu_fx_compiler.py, `_compile_graph_with_aot`): runs
AOTAutograd on the graph, which decomposes every CompositeImplicit op, with
`keep_inference_input_mutations=True`. The graph that comes out is what torchair's converters
would see (`aot_graphs`); the stand-in runs it eagerly. That step depends only on the graph
and its inputs' shapes, so the stand-in does it once per host for each graph it is handed (the
host's other ranks load the result: `runtime.host_cache.shared`), where torchair does
it on every rank. torchair's own decomposition table
(`_c10d_functional.all_to_all_single` -> its HCCL all-to-all op) is not applied: the functional
all-to-all stays, and runs on gloo. torch_npu's ops graph mode uses are defined with their
schemas and CPU kernels (`register_npu_ops`).

    standin = TorchairStandIn()
    with dsv41_compile.core.hooks.installed(Hooks(torchair=standin)):
        compiled(input_ids, positions, slots, cache)  # lowering="torchair"
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import torch
from torch.fx import GraphModule
from torch.library import Library

from dsv41_compile.core.torch_private import OpOverload, aot_module_simplified, make_boxed_func
from dsv41_compile.runtime.host_cache import load_graph, program_key, save_graph, shared

__all__ = [
    "Strict",
    "TorchairStandIn",
    "aot_graph",
    "graph_ops",
    "op_name",
    "register_npu_ops",
]


class Strict(SimpleNamespace):
    """Like torchair's config sections: setting an attribute it does not have is an error."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self.__dict__:
            raise AttributeError(f"torchair's CompilerConfig has no {name!r}")
        super().__setattr__(name, value)


class TorchairStandIn:
    """`torch_npu.dynamo.torchair` as the torchair lowering uses it."""

    def __init__(self) -> None:
        register_npu_ops()  # importing torch_npu registers its ops; so does the stand-in
        self.handed: list[tuple[GraphModule, list[Any], Any]] = []
        self.aot_graphs: list[GraphModule] = []

    @staticmethod
    def CompilerConfig() -> Strict:
        return Strict(
            mode="reduce-overhead",  # not torchair's default: the lowering must set it
            experimental_config=Strict(frozen_parameter=False),
            debug=Strict(graph_dump=Strict(type=None, path=None)),
        )

    def get_npu_backend(self, *, compiler_config: Any) -> Any:
        def backend(gm: GraphModule, example_inputs: list[Any]) -> Any:
            self.handed.append((gm, example_inputs, compiler_config))
            graph = _aot_graph_for_host(gm, example_inputs)
            self.aot_graphs.append(graph)
            return graph.forward

        return backend


def op_name(target: object) -> str:
    """The name torchair registers `target`'s converter under: `torch.ops.aten.mm.default`,
    `operator.add` (read by tools/torchair_coverage.py)."""
    if isinstance(target, OpOverload):
        return f"torch.ops.{target.namespace}.{target._opname}.{target._overloadname}"
    module = getattr(target, "__module__", "") or ""
    return f"{module.removeprefix('_')}.{getattr(target, '__name__', target)}"


def graph_ops(gm: GraphModule) -> Counter[str]:
    """How often each op (by `op_name`) is called in `gm`."""
    return Counter(op_name(n.target) for n in gm.graph.nodes if n.op == "call_function")


def aot_graph(gm: GraphModule, example_inputs: list[Any]) -> GraphModule:
    """The ATen graph torchair's AOT step makes of `gm` (what its converters see)."""
    graphs: list[GraphModule] = []

    def compiler(aot_gm: GraphModule, _inputs: list[Any]) -> Any:
        graphs.append(aot_gm)
        return make_boxed_func(aot_gm.forward)

    aot_module_simplified(
        gm,
        example_inputs,
        fw_compiler=compiler,
        inference_compiler=compiler,
        keep_inference_input_mutations=True,
    )
    (graph,) = graphs
    return graph


def _aot_graph_for_host(gm: GraphModule, example_inputs: list[Any]) -> GraphModule:
    """`aot_graph(gm, example_inputs)`, made by the first rank of the host that needs it and
    loaded by the others. The graph keeps the cache writes (`keep_inference_input_mutations`)
    and aliases no input, so it runs on the handed inputs as they are, like the AOT step's
    own wrapper does."""
    key = program_key(gm, example_inputs, ("torchair-standin-aot",))
    if key is None:  # inputs' symbols without canonical names: no key to share under
        return aot_graph(gm, example_inputs)
    with shared(key, folder="torchair_standin") as slot:
        if slot.artifact is None:
            graph = aot_graph(gm, example_inputs)
            slot.store(save_graph(graph))
            return graph
        saved = slot.artifact
    return load_graph(saved)  # outside the lock: the host's ranks load at the same time


# torch_npu's grouped matmul, for graph mode's routed experts (targets/graph_mode.py). Schema
# from torch-npu 2.13.0's csrc/aten/npu_native_functions_by_codegen.yaml:445.
GROUPED_MATMUL_SCHEMA = (
    "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, "
    "Tensor[]? scale=None, Tensor[]? offset=None, Tensor[]? antiquant_scale=None, "
    "Tensor[]? antiquant_offset=None, Tensor[]? per_token_scale=None, Tensor? group_list=None, "
    "Tensor[]? activation_input=None, Tensor[]? activation_quant_scale=None, "
    "Tensor[]? activation_quant_offset=None, int? split_item=0, int? group_type=None, "
    "int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, int? output_dtype=None, "
    "int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, "
    "int? per_token_scale_dtype=None) -> Tensor[]"
)
_LIBRARY: list[Library] = []


def register_npu_ops() -> None:
    """Define `torch.ops.npu.npu_grouped_matmul` on a machine without torch_npu: its schema,
    a shape function, and a CPU kernel for the one form graph mode uses (documented in
    torch_npu's `_op_plugin_docs.py`): one 2-D `x`, one 3-D `weight` [G, K, N], `group_list`
    the row count of each group (`group_list_type=1`), groups along x's rows (`group_type=0`),
    one output (`split_item=3`): rows [start_g, start_g + count_g) of x times weight[g]. The
    documentation does not say what the NPU kernel leaves in rows past the last group; here
    they are NaN, so a graph that reads them fails its numerics. Any other form is an error.
    No-op when the op exists."""
    if hasattr(torch.ops.npu, "npu_grouped_matmul"):  # torch_npu's, or already defined
        return
    library = Library("npu", "FRAGMENT")
    library.define(GROUPED_MATMUL_SCHEMA)
    library.impl("npu_grouped_matmul", _grouped_matmul_cpu, "CPU")
    torch.library.register_fake("npu::npu_grouped_matmul", _grouped_matmul_fake, lib=library)
    _LIBRARY.append(library)  # keep the registration alive


def _grouped_form(x, weight, group_list, split_item, group_type, group_list_type, **rest):
    unsupported = {k: v for k, v in rest.items() if v not in (None, 0)}
    if (
        len(x) != 1
        or len(weight) != 1
        or x[0].dim() != 2
        or weight[0].dim() != 3
        or group_list is None
        or (split_item, group_type, group_list_type) != (3, 0, 1)
        or unsupported
    ):
        raise ValueError(
            "the CPU stand-in of npu_grouped_matmul implements one form: x=[2-D], "
            "weight=[3-D], group_list=counts, split_item=3, group_type=0, group_list_type=1; "
            f"got split_item={split_item}, group_type={group_type}, "
            f"group_list_type={group_list_type}, other arguments {unsupported}"
        )
    return x[0], weight[0]


def _grouped_matmul_cpu(
    x, weight, *, group_list=None, split_item=0, group_type=None, group_list_type=0, **rest
):
    x, weight = _grouped_form(
        x, weight, group_list, split_item, group_type, group_list_type, **rest
    )
    out = x.new_full((x.shape[0], weight.shape[2]), float("nan"))
    start = 0
    for g, count in enumerate(group_list.tolist()):
        out[start : start + count] = x[start : start + count] @ weight[g]
        start += count
    return [out]


def _grouped_matmul_fake(
    x, weight, *, group_list=None, split_item=0, group_type=None, group_list_type=0, **rest
):
    x, weight = _grouped_form(
        x, weight, group_list, split_item, group_type, group_list_type, **rest
    )
    return [x.new_empty((x.shape[0], weight.shape[2]))]
