"""The torchair lowering (Ascend NPU, graph mode): the per-rank ATen graph goes to torchair's
Dynamo backend, `torch_npu.dynamo.torchair.get_npu_backend(compiler_config=...)`.

Why that entry rather than `get_compiler` (read from torch-npu 2.13.0's source; see
docs/research/torchair_2.13.0.md): `get_npu_backend` re-runs AOTAutograd on our functional graph
with torchair's decomposition table, the only place where `_c10d_functional.all_to_all_single`
becomes `npu_define.all_to_all_single_npu` (the one all-to-all with a GE converter), and it marks
`nn.Parameter` example inputs for `frozen_parameter`. `get_compiler` would need both done by us.
The all-gather / reduce-scatter / all-reduce converters resolve the HCCL group while compiling,
so the process group exists by then (the backend compiles on the first call).

Before the hand-off, this target's pass, graph_mode (`targets/npu_passes.py`), has replaced
the ops torchair cannot convert. Status: checked on CPU only -- every op handed over has a
torchair converter (`tools/torchair_coverage.py`, read from torch-npu 2.13.0's source), and the
graph, run on CPU by `testing.torchair_standin`, matches the single-device model. Nothing here
has run on an NPU (`tools/npu_smoke.py` is the hardware check).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule

from dsv41_compile.core.hooks import active
from dsv41_compile.options import BackendOptions
from dsv41_compile.targets.base import Handoff, needs_torch_npu

__all__ = ["compiler_config", "import_torchair", "lower_torchair"]

INSTALL = needs_torch_npu("torchair", "torchair ships in it as torch_npu.dynamo.torchair")


def import_torchair() -> Any:
    """`torch_npu.dynamo.torchair` (or the stand-in an installed hook supplies), or a
    ValueError that says what to install."""
    for hooks in reversed(active()):
        if hooks.torchair is not None:
            return hooks.torchair
    try:
        from torch_npu.dynamo import torchair
    except ImportError as error:
        raise ValueError(f"{INSTALL} ({error})") from None
    return torchair


def compiler_config(torchair: Any, options: BackendOptions, rank: int) -> Any:
    """torchair's `CompilerConfig` from our options: GE graph mode ("max-autotune"), the
    parameters frozen into the graph (they are sliced once and reused, `ShardedProgram`), and
    with `dump_dir` torchair's own graph dump (`py`) in `dump_dir/rank{r}/torchair`."""
    config = torchair.CompilerConfig()
    config.mode = "max-autotune"
    config.experimental_config.frozen_parameter = True
    if options.dump_dir is not None:
        path = Path(options.dump_dir) / f"rank{rank}" / "torchair"
        path.mkdir(parents=True, exist_ok=True)
        config.debug.graph_dump.type = "py"
        config.debug.graph_dump.path = str(path)
    return config


def lower_torchair(gm: GraphModule, handoff: Handoff) -> Callable[..., Any]:
    """The per-rank graph compiled by torchair. With ep > 1 the EP lowering is the padded one
    (`BackendOptions` refuses the exact one: it reads counts on the host)."""
    torchair = import_torchair()
    config = compiler_config(torchair, handoff.options, handoff.rank)
    backend = torchair.get_npu_backend(compiler_config=config)
    inputs = list(handoff.example_inputs)
    with handoff.fake_mode:  # weights as nn.Parameter: what torchair freezes into the graph
        for index in handoff.param_indices:
            inputs[index] = torch.nn.Parameter(inputs[index], requires_grad=False)
    return backend(gm, inputs)
