"""A CPU stand-in for torch_npu's npugraph_ex, for tests (torch_npu cannot be installed without the
Ascend toolkit).

It replaces the entry point the npugraph_ex lowering calls, `get_npu_backend(compiler_config=)`,
and the flat `CompilerConfig` it builds, with the fields and allowed values of torch-npu
2.13.0's (`torch_npu/dynamo/npugraph_ex/configs/compiler_config.py`; setting another field, or a
value outside a field's choices, is an error, as there). Its backend records what it is handed,
makes the graph npugraph_ex's AOT step would make (AOTAutograd with
`keep_inference_input_mutations=True` and no decomposition table but its collectives', which
the stand-in leaves as the functional ones gloo runs: `testing.torchair_standin.aot_graph`,
once per host), and runs it eagerly. Each call is recorded as npugraph_ex would treat it: with
`force_eager` uncaptured, else a capture on the first call of a size (the token count) and a
replay after; past `capture_limit` sizes npugraph_ex drops its captures and runs eagerly, which
the stand-in refuses.

    standin = NpugraphExStandIn()
    with dsv41_compile.core.hooks.installed(Hooks(npugraph_ex=standin)):
        compiled(input_ids, positions, slots, cache)  # lowering="npugraph_ex"
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule

from dsv41_compile.testing.torchair_standin import aot_graph_for_host, register_npu_ops

__all__ = ["NpugraphExStandIn", "StandInConfig"]

_BOOL = (True, False)
_FIELDS: dict[str, tuple[Any, tuple[Any, ...] | None]] = {
    # name: (default, allowed values or None for any)
    "force_eager": (False, _BOOL),
    "use_graph_pool": (None, None),
    "reuse_graph_pool_in_same_fx": (True, _BOOL),
    "capture_limit": (64, None),
    "clone_input": (True, _BOOL),
    "clone_output": (False, _BOOL),
    "disable_static_kernel_compile_cache": (False, _BOOL),
    "static_kernel_compile": (False, _BOOL),
    "frozen_parameter": (False, _BOOL),
    "remove_noop_ops": (True, _BOOL),
    "remove_cat_ops": (True, _BOOL),
    "inplace_pass": (True, _BOOL),
    "input_inplace_pass": (True, _BOOL),
    "pattern_fusion_pass": (True, _BOOL),
    "post_grad_custom_pre_pass": (None, None),
    "post_grad_custom_post_pass": (None, None),
    "dump_tensor_data": (False, _BOOL),
    "data_dump_stage": ("optimized", ("original", "optimized")),
    "data_dump_dir": ("./", None),
    "_vllm_aclnn_static_kernel_sym_index": (0, None),
    "_vllm_aclnn_static_kernel_sym_range": (None, None),
    "super_kernel_optimize": (False, _BOOL),
    "super_kernel_optimize_options": (None, None),
    "super_kernel_debug_options": (None, None),
    "deadlock_check": (False, _BOOL),
    "capture_error_mode": ("global", ("global", "thread_local", "relaxed")),
    "mode": ("npugraph_ex", ("npugraph_ex",)),
    "force_recapture": (False, _BOOL),
    "unsafe_skip_npugraph_capture_validation": (False, _BOOL),
    "record_statistics_debug_info": (False, _BOOL),
}


class StandInConfig:
    """npugraph_ex's flat config: its fields, their defaults, their allowed values."""

    def __init__(self) -> None:
        for name, (default, _) in _FIELDS.items():
            object.__setattr__(self, name, default)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _FIELDS:
            raise AttributeError(f"npugraph_ex's CompilerConfig has no {name!r}")
        allowed = _FIELDS[name][1]
        if allowed is not None and value not in allowed:
            raise ValueError(f"npugraph_ex's {name} takes one of {allowed}, got {value!r}")
        if name == "capture_limit" and not (isinstance(value, int) and value >= 1):
            raise ValueError(f"npugraph_ex's capture_limit is an int >= 1, got {value!r}")
        object.__setattr__(self, name, value)


class NpugraphExStandIn:
    """torch_npu's `npugraph_ex` as the npugraph_ex lowering uses it."""

    @staticmethod
    def CompilerConfig() -> StandInConfig:
        return StandInConfig()

    def __init__(self) -> None:
        register_npu_ops()  # importing torch_npu registers its ops; so does the stand-in
        self.handed: list[tuple[GraphModule, list[Any], StandInConfig]] = []
        self._aot: dict[int, GraphModule] = {}
        self.calls: list[tuple[str, int]] = []
        """Per call: "capture", "replay" or "uncaptured", and the token count."""

    @property
    def aot_graphs(self) -> list[GraphModule]:
        """The graphs npugraph_ex's AOT step made, one per graph handed over."""
        return list(self._aot.values())

    def get_npu_backend(self, *, compiler_config: StandInConfig) -> Any:
        config: Any = compiler_config  # its fields are set in __init__, by name

        def backend(gm: GraphModule, example_inputs: list[Any]) -> Any:
            self.handed.append((gm, example_inputs, config))
            if id(gm) not in self._aot:  # the lowering hands each graph over twice
                self._aot[id(gm)] = aot_graph_for_host(gm, example_inputs)
            graph = self._aot[id(gm)]
            sizes: set[tuple[int, ...]] = set()
            dynamic = [i for i, x in enumerate(example_inputs) if _is_symbolic(x)]

            def run(*args: Any) -> Any:
                key = tuple(int(args[i].shape[0]) for i in dynamic)
                tokens = key[0] if key else 0
                if config.force_eager:
                    self.calls.append(("uncaptured", tokens))
                elif key in sizes:
                    self.calls.append(("replay", tokens))
                else:
                    if len(sizes) == config.capture_limit:
                        raise RuntimeError(
                            f"npugraph_ex would drop its {len(sizes)} captures and run eagerly "
                            f"from here on (capture_limit={config.capture_limit})"
                        )
                    sizes.add(key)
                    self.calls.append(("capture", tokens))
                return graph.forward(*args)

            return run

        return backend


def _is_symbolic(x: Any) -> bool:
    """A tensor input whose first size is symbolic: what npugraph_ex keys its captures by."""
    return isinstance(x, torch.Tensor) and x.dim() > 0 and isinstance(x.shape[0], torch.SymInt)
